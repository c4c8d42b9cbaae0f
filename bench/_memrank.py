"""One rank of `bench/memory.py`: `recover.Replica` steps whose compute only adds a known gradient.

Invariant: the only tensors this process allocates while its profile runs are the model's own
gradient (the layout's flat buffer, `plain.flat_grad_buffer`, or, under hsdp, the shard gradients
that `compute` creates, as FSDP2's backward would), this file's checks, and what recover itself
allocates. There is no forward pass, so no activation: every other byte on the training thread
is recover's ("protocol"). Each microbatch id adds the integer-gradient oracle's weight to every
element of every gradient (`harness.oracle`, in place: no allocation), so the reduced
step gradient is exactly `oracle.expected(step, N)` everywhere, whoever computed which id; every
step is checked against that. Faults hit a replica's last rank right after it issued its reduce:
`--kill STEP:REPLICA` SIGKILLs it (a crash mid-reduce: its sockets close), `--hang STEP:REPLICA`
SIGSTOPs it (a hang: its sockets stay open, so the survivors' operation stays in flight until
they abandon it when the coordinator declares the replica lost).

    python bench/_memrank.py --coordinator H:P --replica r [--rank k --nranks K] --layout L \
        --result out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from _alloc import Window, ledger, window
from harness import oracle
from recover.procs import exit_after

log = logging.getLogger("bench.memrank")

# The model's own gradient, allocated by recover on the layout's behalf (plain: every .grad is a
# view of one flat buffer) or by this file's compute (hsdp): never counted as recover's extra.
MODEL_SITES = ("flat_grad_buffer",)


def owner_of(site: str) -> str:
    if site.startswith(("bench/_memrank.py", "bench/harness/")):
        return "model"  # the compute's gradients (the oracle's) and this file's checks
    if any(f" {fn}" in site for fn in MODEL_SITES):
        return "model"
    return "protocol" if site.startswith("recover/") else "other"


def rss_kb(field: str) -> int:
    """VmRSS / VmHWM of this process, in kB (the HWM is reset by `reset_hwm`)."""
    m = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(m.group(1)) if m else -1


def reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class Model(nn.Module):
    """Three 2-D weights (sharded on rows under hsdp) holding `numel` elements per rank."""

    def __init__(self, numel: int, shards: int, dtype: torch.dtype) -> None:
        super().__init__()
        cols = 1000
        rows = [numel * f // (10 * cols) for f in (5, 3, 2)]
        self.w = nn.ParameterList(nn.Parameter(torch.zeros(r * shards, cols, dtype=dtype))
                                  for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--nranks", type=int, default=1)
    ap.add_argument("--layout", choices=("plain", "hsdp"), default="plain")
    ap.add_argument("--numel", type=int, default=10_000_000, help="gradient elements per rank")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kill", help="STEP:REPLICA killed mid-reduce")
    ap.add_argument("--hang", help="STEP:REPLICA stopped mid-reduce")
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--result", required=True)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    n, host, port = a.microbatches, *a.coordinator.rsplit(":", 1)
    mesh = None
    model = Model(a.numel, a.nranks if a.layout == "hsdp" else 1, torch.float32)
    if a.layout == "hsdp":
        from recover.layouts import init_replica_group
        from recover.layouts.hsdp import shard_mesh, shard_model

        init_replica_group(host, int(port), a.replica, a.rank, a.nranks, a.timeout_s)
        mesh = shard_mesh(a.nranks)
        shard_model(model, mesh)
    from recover import Replica
    from recover.layouts.sharded import local_tensor
    from recover.settings import FaultTolerance, Hooks, Numerics, ReplicaConfig

    params = list(model.parameters())
    grad_bytes = sum(local_tensor(p).numel() * p.element_size() for p in params)
    faults = {}  # step -> signal, for this rank
    for spec, sig in ((a.kill, signal.SIGKILL), (a.hang, signal.SIGSTOP)):
        if spec:
            at, who = (int(x) for x in spec.split(":"))
            if who == a.replica and a.rank == a.nranks - 1:
                faults[at] = sig

    def hook(phase: str, step: int, j: int) -> None:
        if phase == "reduce" and step in faults:
            log.warning("replica %d rank %d: %s mid-reduce of step %d", a.replica, a.rank,
                        faults[step].name, step)
            os.kill(os.getpid(), faults.pop(step))

    def compute(mb_id: int, j: int) -> float:
        with torch.no_grad():
            for p in params:
                if p.grad is None:  # hsdp: the layout frees its gradients between steps
                    p.grad = torch.zeros_like(p)
                oracle.add(local_tensor(p.grad), mb_id)
        return oracle.loss(mb_id)

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True)
    prof.start()
    with record_function("bench.setup"):
        config = ReplicaConfig(coordinator=a.coordinator, replica=a.replica,
                               ft=FaultTolerance(reduce_timeout_s=a.timeout_s, speed_aware=False),
                               numerics=Numerics(exact=a.exact))
        rep = Replica(model, n, mesh=mesh, config=config, hooks=Hooks(at_phase=hook))
    steps, hwm_ok = [], True
    for t in range(a.steps):
        want = oracle.expected(t, n)
        rss0 = rss_kb("VmRSS")
        hwm_ok = reset_hwm() and hwm_ok
        t0 = time.monotonic()
        with record_function(f"bench.step{t}"):
            res = rep.step(t, compute)
        wall = time.monotonic() - t0
        rss_peak = rss_kb("VmHWM")
        lo = min(float(local_tensor(p.grad).min()) for p in params)
        hi = max(float(local_tensor(p.grad).max()) for p in params)
        if not lo == hi == want or res.microbatches != n:
            log.error("step %d: gradient in [%s, %s], %d microbatches; expected %s everywhere "
                      "and %d", t, lo, hi, res.microbatches, want, n)
            return 1
        steps.append({"step": t, "attempts": res.attempts, "generation": res.generation,
                      "members": res.members, "recovered": res.recovered, "wall_s": wall,
                      "rss_delta": (rss_peak - rss0) * 1024 if hwm_ok else None})
    prof.stop()
    events, spans = ledger(prof, owner_of)

    def when(t: int) -> str:
        """The span (setup, step k) an allocation was made in."""
        name = next((k for k, (lo, hi) in spans.items() if lo <= t <= hi), "")
        return name.removeprefix("bench.").replace("step", "step ")

    for s in steps:
        lo, hi = spans[f"bench.step{s['step']}"]
        w: Window = window(events, lo, hi, "protocol", when)
        other = window(events, lo, hi, "other")
        s.update(start=w.start, peak=w.peak, end=w.end, at_peak=w.at_peak, other_peak=other.peak)
    Path(a.result).write_text(json.dumps({
        "replica": a.replica, "rank": a.rank, "layout": a.layout, "exact": a.exact,
        "grad_bytes": grad_bytes, "steps": steps}))
    rep.leave()
    return 0


if __name__ == "__main__":
    exit_after(main)
