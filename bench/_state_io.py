"""The processes of `bench/rejoin.py`'s size sweep: a donor, a joiner, and a checkpoint loader.

Each builds the same model (an nn.Sequential of 1024x1024 Linear layers, ~P parameters) with
AdamW state materialized (params + exp_avg + exp_avg_sq + step), does one job, and writes one
JSON result file. The donor and joiner move the state exactly as `recover.replica.rejoin` does
(`transfer.TrainingState` with a `rejoin.StepState`, `transfer.send` / `transfer.receive` over a
`channel` session keyed by a token, on a loopback TCP socket), then move the same tensors' bytes
--repeats times again with no channel at all (`raw`: one `sendall` per tensor from its memory,
`recv_into` its joiner's memory, no handshake, frame or cipher): the link's own speed on this
machine, what no transfer over the socket can beat; the loader saves the same state
with `torch.distributed.checkpoint` (`no_dist`) and times loading it into a fresh model +
optimizer.

Invariant: every result carries the state's fingerprint (an order-fixed float64 sum of every
tensor) as the receiving side holds it after the last receive or load (the raw moves included);
the loader refuses (exits
non-zero) unless it equals what it saved, and `bench/rejoin.py` refuses a size whose joiner's
fingerprint differs from its donor's. A time is never reported for state that did not arrive.

    python bench/_state_io.py donor  --params P --repeats K --port-file F --result R
    python bench/_state_io.py joiner --params P --repeats K --port-file F --result R
    python bench/_state_io.py ckpt   --params P --repeats K --dir D --result R
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from recover.replica import channel, transfer
from recover.replica.rejoin import StepState

WIDTH = 1024
CONNECT_S = 120.0  # the peer imports torch and builds ~1 GB of state first on a loaded machine
KEY, CTX = b"bench run token", channel.context(0, 0)  # as a run's: handshake + AES-GCM frames


def build(params: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """~`params` parameters with AdamW state; `seed` makes donor and joiner differ before."""
    torch.manual_seed(seed)
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    transfer.materialize_optimizer(opt)
    with torch.no_grad():  # non-zero moments, as after real steps (the bytes are what count)
        for st in opt.state.values():
            st["exp_avg"].normal_()
            st["exp_avg_sq"].uniform_()
            st["step"].fill_(float(seed + 7))
    return model, opt


def memory(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's own bytes (written through by a receive)."""
    assert t.device.type == "cpu" and t.is_contiguous(), "the bench's state is dense on the CPU"
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Order-fixed float64 sum of every tensor: equal on both sides only if the values are."""
    state = transfer.TrainingState(model, opt, {})
    return float(sum(t.double().sum() for _, t in state.tensors))


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    state = transfer.TrainingState(model, opt, {"_recover": StepState(None)})
    return sum(t.numel() * t.element_size() for _, t in state.tensors)


def donor(a: argparse.Namespace) -> dict:
    model, opt = build(a.params, seed=0)
    times = []
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.settimeout(CONNECT_S)
        tmp = Path(f"{a.port_file}.tmp")  # rename: the joiner never reads half a port number
        tmp.write_text(str(srv.getsockname()[1]))
        tmp.rename(a.port_file)
        for _ in range(a.repeats):
            session = channel.accept(srv, KEY, CTX, CONNECT_S)
            with session.sock:
                session.sock.settimeout(CONNECT_S)
                t0 = time.monotonic()  # as rejoin.serve: the state is gathered per donation
                st = StepState(None)
                state = transfer.TrainingState(model, opt, {"_recover": st})
                sent = transfer.send(session, state.tensors, state.meta)
                times.append(time.monotonic() - t0)
        for _ in range(a.repeats):  # the link alone: the same bytes, no channel
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(CONNECT_S)
                for _, t in transfer.TrainingState(model, opt, {}).tensors:
                    conn.sendall(memory(t))
                channel.recv_exact(conn, 1)  # the joiner has every byte
    return {"send_s": times, "bytes": sent, "fingerprint": fingerprint(model, opt),
            "params": sum(p.numel() for p in model.parameters())}


def joiner(a: argparse.Namespace) -> dict:
    model, opt = build(a.params, seed=1)
    deadline = time.monotonic() + CONNECT_S
    while not Path(a.port_file).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the donor never published its port")
        time.sleep(0.02)
    addr = f"127.0.0.1:{Path(a.port_file).read_text()}"
    times, got = [], 0
    for _ in range(a.repeats):
        st = StepState(None)
        state = transfer.TrainingState(model, opt, {"_recover": st})
        t0 = time.monotonic()  # the same window as rejoin.receive's `transfer_s`
        with transfer.connect(addr, CONNECT_S) as sock:
            sock.settimeout(CONNECT_S)
            meta, got = transfer.receive(channel.join(sock, KEY, CTX), state.tensors, state.meta)
        times.append(time.monotonic() - t0)
        state.finish(meta)
    raw, raw_bytes = [], 0
    for _ in range(a.repeats):
        t0 = time.monotonic()
        with transfer.connect(addr, CONNECT_S) as sock:
            sock.settimeout(CONNECT_S)
            tensors = [t for _, t in transfer.TrainingState(model, opt, {}).tensors]
            for t in tensors:
                channel.recv_exact_into(sock, memory(t))  # in place
            raw_bytes = sum(t.numel() * t.element_size() for t in tensors)
            sock.sendall(b"k")
        raw.append(time.monotonic() - t0)
    return {"receive_s": times, "raw_s": raw, "raw_bytes": raw_bytes, "bytes": got,
            "fingerprint": fingerprint(model, opt)}


def ckpt(a: argparse.Namespace) -> dict:
    # DCP warns on every no_dist call that it assumes one process; that is the intent here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    path = Path(a.dir) / "ckpt"
    model, opt = build(a.params, seed=0)
    want = fingerprint(model, opt)
    msd, osd = get_state_dict(model, opt)
    t0 = time.monotonic()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
    save_s = time.monotonic() - t0
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    del model, opt, msd, osd
    model, opt = build(a.params, seed=1)  # a fresh process's model + optimizer
    times = []
    try:
        for _ in range(a.repeats):
            t0 = time.monotonic()  # state_dict views, read + copy in, then into the optimizer
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=path, no_dist=True)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            times.append(time.monotonic() - t0)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    got = fingerprint(model, opt)
    if got != want:
        raise RuntimeError(f"checkpoint load changed the state: {got!r} != {want!r}")
    return {"load_s": times, "save_s": save_s, "file_bytes": on_disk,
            "bytes": state_bytes(model, opt), "fingerprint": got}


def main() -> int:
    ap = argparse.ArgumentParser(prog="bench/_state_io.py")
    ap.add_argument("role", choices=["donor", "joiner", "ckpt"])
    ap.add_argument("--params", type=float, required=True)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--port-file")
    ap.add_argument("--dir")
    ap.add_argument("--result", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)  # both sides alike; the machine is shared
    out = {"donor": donor, "joiner": joiner, "ckpt": ckpt}[a.role](a)
    Path(a.result).write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
