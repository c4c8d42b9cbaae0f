"""Growing back: live state transfer vs a checkpoint load, and the protocol time of a rejoin.

What:
1. Transfer, per size (~10M, 50M, 100M parameters; AdamW state materialized, so params + two
   moments = 12 bytes per parameter): a donor process and a joiner process (`_state_io.py`) move
   the state over loopback TCP exactly as `recover.replica.rejoin` does (`TrainingState`,
   `transfer.send` / `receive`: token handshake, AES-GCM frames, each decrypted straight
   into the joiner's tensors).
   Time = the joiner's window of `transfer_s` (connect -> verified and copied in). Median of
   --repeats.
2. Checkpoint load of the same state: saved once with `torch.distributed.checkpoint`
   (`no_dist`) into a temp dir, then loaded into a fresh model + optimizer (get_state_dict,
   dcp.load, set_state_dict). The files were just written, so they are read from the page
   cache: dropping it needs root on a machine shared with others, so it is not done. This
   favours the checkpoint (a real restart reads remote or cold storage, and recover's own
   checkpoints also verify a sha256 per file; this load does neither).
3. Protocol of a real rejoin: `recover train --preset debug --steps 30 --eval-every 0 --fault
   kill:replica=2,step=10,phase=backward --fault restart:replica=2,step=15`. From
   coordinator.jsonl (absolute clocks), metrics.jsonl (`time_s` since D/run_start) and the
   replica logs. The join is served at step boundary t (the restart fault's step: a joiner that
   registers earlier waits for it while the others train on, which costs no one anything):
   window = from the later of the coordinator's `join` event (the joiner's ranks have all
   registered) and step t-1's commit, to the first committed step that counts the joiner
   (step t). That window holds step t itself (compute, reduce, optimizer: what any step takes)
   and the transfer: protocol = window - the joiner's `transfer_s` - the steady step period
   (median commit-to-commit after the join), i.e. what the join step took beyond an ordinary
   step and the transfer. The window and its parts are printed beside it.

4. The link alone: after its sealed transfers the same donor and joiner move the same tensors'
   bytes again over a fresh loopback connection with no channel (no handshake, frame or cipher;
   `sendall` from each tensor's memory, `recv_into` the joiner's): the most any transfer over
   this socket can move here, so the ceiling of `rejoin_vs_dcp_load` on this machine.

Last lines: `link_gbps=<the link alone at the largest size>`, `rejoin_vs_link=<transfer GB/s /
link GB/s>`, `link_vs_dcp_load=<DCP load s / the link's time for the same bytes>` (the ceiling of
the next), `rejoin_vs_dcp_load=<DCP load s / transfer s at the largest size>`, then
`rejoin_protocol_s=<median over runs>` then `rejoin_gbps=<GB/s (1e9 bytes/s) of state moved by
the transfer at the largest size>`.

    python bench/rejoin.py --smoke    # 1M only, one repeat + one 12-step rejoin run (CI)
    python bench/rejoin.py --quick    # 10M only + one protocol run, < 3 min on 2 cores
    python bench/rejoin.py            # 10M, 50M, 100M + three protocol runs
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from _common import (
    BENCH_DIR,
    bench_args,
    loadavg,
    median,
    out_dir,
    periods,
    recover_train,
    say,
    table,
)
from recover.app import rundir
from recover.procs import start, stop_all

log = logging.getLogger("bench.rejoin")
JOINER = 2


def train_flags(steps: int, kill: int, join: int, replicas: int = 0) -> list[str]:
    """The protocol run's `recover train` flags: replica JOINER killed at `kill`, back at `join`
    (replicas 0: the preset's)."""
    return ["--steps", str(steps), "--eval-every", "0", "--fault",
            f"kill:replica={JOINER},step={kill},phase=backward", "--fault",
            f"restart:replica={JOINER},step={join}",
            *(["--replicas", str(replicas)] if replicas else [])]


# (steps, kill step, join step, replicas): the full run, and --smoke's (fewer steps around the
# same events, the fewest replicas that keep two survivors beside the joiner)
TRAIN, SMOKE_TRAIN = (30, 10, 15, 0), (12, 3, 6, 3)


def run_roles(d: Path, roles: list[tuple[str, list[str]]], timeout_s: float) -> list[dict]:
    """Start `_state_io.py` processes side by side; their results, in order. Ended by PID."""
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs, results = [], []
    try:
        for role, args in roles:
            res = d / f"{role}.json"
            res.unlink(missing_ok=True)
            results.append(res)
            procs.append(start([sys.executable, str(BENCH_DIR / "_state_io.py"), role, *args,
                                "--result", str(res)], d / f"{role}.log", env=env))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{[r for r, _ in roles]} exceeded {timeout_s:.0f}s (logs {d})")
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one failed: its peer would only wait for it
            time.sleep(0.05)
    finally:
        stop_all(procs)
    for (role, _), p, res in zip(roles, procs, results, strict=True):
        if p.returncode != 0 or not res.exists():
            tail = (d / f"{role}.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{role} exited {p.returncode} (log {d / role}.log):\n{tail}")
    return [json.loads(r.read_text()) for r in results]


def sweep(params: float, repeats: int, d: Path, timeout_s: float) -> dict:
    common = ["--params", str(params), "--repeats", str(repeats)]
    port = d / "port"
    port.unlink(missing_ok=True)
    don, joi = run_roles(d, [("donor", [*common, "--port-file", str(port)]),
                             ("joiner", [*common, "--port-file", str(port)])], timeout_s)
    if joi["fingerprint"] != don["fingerprint"] or joi["bytes"] != don["bytes"]:
        raise RuntimeError(f"the joiner's state differs from the donor's at {params:.0f} params")
    (ck,) = run_roles(d, [("ckpt", [*common, "--dir", str(d)])], timeout_s)
    if ck["fingerprint"] != don["fingerprint"]:
        raise RuntimeError("the checkpoint holds other values than the donor")  # same seed
    return {"params": don["params"], "bytes": don["bytes"], "transfer_s": median(joi["receive_s"]),
            "raw_s": median(joi["raw_s"]), "raw_bytes": joi["raw_bytes"],
            "send_s": median(don["send_s"]), "load_s": median(ck["load_s"]),
            "save_s": ck["save_s"], "file_bytes": ck["file_bytes"]}


def link_gbps(r: dict) -> float:
    """GB/s of the raw moves (`_state_io.py`: the link alone, no channel)."""
    return r["raw_bytes"] / r["raw_s"] / 1e9


def events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by the end of the run
    return out


def protocol(out: Path, timeout_s: float, train: tuple[int, int, int, int] = TRAIN) -> dict:
    records, _ = recover_train(out, "debug", train_flags(*train), timeout_s)
    run_start = float((out / rundir.RUN_START).read_text())
    ev = events(out / rundir.COORDINATOR_LOG)
    adm = next(e for e in ev if e["event"] == "generation"
               and str(e["reason"]).startswith(f"replica {JOINER} admitted"))
    epoch = int(re.search(r"join (\d+)", adm["reason"]).group(1))  # type: ignore[union-attr]
    join = next(e for e in ev if e["event"] == "join" and e["replica"] == JOINER
                and e["epoch"] == epoch)
    first = next(r for r in records if JOINER in r.get("joined", []))
    commit = run_start + first["time_s"]
    before = next(r for r in records if r["step"] == first["step"] - 1)
    start = max(join["time"], run_start + before["time_s"])
    live = {r["live_replicas"] for r in records if r["step"] > first["step"]}
    logs = "".join(p.read_text(errors="replace") for p in sorted((out / rundir.LOGS).glob("*.log")))
    donated = re.search(r"donated ([\d.]+) MB of state at step (\d+)", logs)
    steady = median(periods(records, first["step"] + 3, len(records)))
    return {"join_to_admit_s": adm["time"] - start, "transfer_s": first["transfer_s"],
            "admit_to_commit_s": commit - adm["time"], "first_step": first["step"],
            "window_s": commit - start, "steady_period_s": steady,
            "waited_s": max(0.0, start - join["time"]),
            "protocol_s": commit - start - first["transfer_s"] - steady, "live_after": live,
            "donated_mb": float(donated.group(1)) if donated else float("nan")}


def main() -> int:
    ap = bench_args(__doc__, "10M only + one protocol run (< 3 min)", "1M only, one repeat, "
                    "one 12-step protocol run")
    ap.add_argument("--sizes", help="comma-separated parameter counts (default 10e6,50e6,100e6)")
    ap.add_argument("--repeats", type=int, help="transfers / loads per size (default 2 quick, 3)")
    ap.add_argument("--runs", type=int, help="protocol runs (default 1 quick, 3)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per process / run")
    a = ap.parse_args()
    out = out_dir(a.out, "rejoin")
    sizes = [float(s) for s in a.sizes.split(",")] if a.sizes else (
        [1e6] if a.smoke else [10e6] if a.quick else [10e6, 50e6, 100e6])
    repeats = a.repeats or (1 if a.smoke else 2 if a.quick else 3)
    runs = a.runs or (1 if a.quick or a.smoke else 3)
    train = SMOKE_TRAIN if a.smoke else TRAIN
    say(f"rejoin bench: sizes {[f'{s / 1e6:.0f}M' for s in sizes]}, {repeats} repeats, {runs} "
        f"protocol run(s); load average {loadavg():.1f} on {os.cpu_count()} CPUs; logs in {out}")
    rows, last = [], None
    for s in sizes:
        r = sweep(s, repeats, out / f"size{s / 1e6:.0f}M", a.timeout_s)
        last = r
        gb = r["bytes"] / 1e9
        rows.append((f"{r['params'] / 1e6:.1f}M", f"{r['bytes'] / 1e6:.0f}",
                     f"{r['transfer_s']:.3f}", f"{gb / r['transfer_s']:.2f}",
                     f"{r['send_s']:.3f}", f"{link_gbps(r):.2f}", f"{r['load_s']:.3f}",
                     f"{gb / r['load_s']:.2f}", f"{r['load_s'] / r['transfer_s']:.2f}x",
                     f"{r['save_s']:.2f}"))
        log.info("%s params done (load average %.1f)", rows[-1][0], loadavg())
    say("\nstate transfer (loopback, AES-GCM, decrypted in place) vs DCP load (page cache "
        "warm: not dropped, see --help)")
    table(rows, ("params", "state MB", "transfer s", "GB/s", "donor s", "link GB/s",
                 "DCP load s", "GB/s", "load/transfer", "DCP save s"))
    prot = [protocol(out / f"train{k}", a.timeout_s, train) for k in range(runs)]
    say(f"\nprotocol of a real rejoin (debug preset, replica {JOINER} killed at step {train[1]}, "
        f"restarted at step {train[2]}; times in s)")
    table([(k, f"{p['waited_s']:.3f}", f"{p['join_to_admit_s']:.3f}", f"{p['transfer_s']:.3f}",
            f"{p['admit_to_commit_s']:.3f}", f"{p['window_s']:.3f}",
            f"{p['steady_period_s']:.3f}", f"{p['protocol_s']:.3f}", p["first_step"],
            ",".join(map(str, sorted(p["live_after"]))), f"{p['donated_mb']:.1f}")
           for k, p in enumerate(prot)],
          ("run", "waited for t", "t->admitted", "transfer", "admitted->commit", "window",
           "steady step", "protocol", "step", "live after", "MB"))
    proto = median([p["protocol_s"] for p in prot])
    say(f"  protocol = window (step t-1's commit or the join, the later -> step t's commit) - "
        f"transfer - steady step; goal <= 0.3 s ({'met' if proto <= 0.3 else 'NOT met'})")
    assert last is not None
    ratio = last["load_s"] / last["transfer_s"]
    say(f"  transfer {ratio:.2f}x the warm-cache DCP load's speed at "
        f"{last['params'] / 1e6:.0f}M (goal >= 2x: {'met' if ratio >= 2 else 'NOT met'}); "
        f"load average now {loadavg():.1f}")
    link, gbps = link_gbps(last), last["bytes"] / last["transfer_s"] / 1e9
    ceiling = link / (last["bytes"] / last["load_s"] / 1e9)  # the link's speed over the load's
    say(f"  the link alone (the same bytes over the same loopback socket, no handshake, frame or "
        f"cipher) moved {link:.2f} GB/s: the transfer ran at {gbps / link:.2f} of it, and no "
        f"transfer over it can pass {ceiling:.2f}x the DCP load here")
    say(f"link_gbps={link:.3f}")
    say(f"rejoin_vs_link={gbps / link:.3f}")
    say(f"link_vs_dcp_load={ceiling:.3f}")
    say(f"rejoin_vs_dcp_load={ratio:.3f}")
    say(f"rejoin_protocol_s={proto:.3f}")
    say(f"rejoin_gbps={gbps:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
