"""Peak extra memory of recover's step, in units of the rank's gradient: failure-free and recovered.

What: "extra" = bytes recover allocates beyond the model's own parameters, gradients and
activations, live at once during a step, on one rank, divided by that rank's gradient bytes (its
local shards under hsdp). Measured on real processes: a coordinator and R replicas (plain: one
rank each; hsdp: --shards FSDP2 ranks each) driving `recover.Replica` directly, each with a
gradient of --numel float32 elements per rank and a compute function that only adds a known
value to it (no model, no activations: every other byte the training thread allocates during
the step is recover's). Steps: 0 warms up (the reusable scratch buffer is made), 1 is
failure-free; in step 2 replica R-1's last rank SIGKILLs itself right after issuing its reduce
(a crash mid-reduce: its sockets close, the survivors' operation fails); in step 4 replica R-2's
last rank SIGSTOPs itself there (a hang: its sockets stay open, so the survivors' operation stays
in flight until the coordinator declares the replica lost after --stale-s and they abandon it,
which is when a buffer gloo may still write into is held); steps 3 and 5 run after each.

How: `torch.profiler.profile(profile_memory=True, with_stack=True)` runs from before the
`Replica` is built to the end, on the training thread, where recover makes every buffer of a
step; `bench/_alloc.py` turns its allocator events into a ledger and attributes each allocation
to the innermost line of recover or bench that made it. The model's own gradient (the plain
layout's flat buffer, `plain.flat_grad_buffer`; hsdp's shard gradients, made by the bench's
compute as FSDP2's backward would) is the model's; the rest of recover's is "extra". The peak
includes what recover holds from earlier steps (the scratch buffer, an abandoned one, exact
mode's accumulator). A second column, the process RSS high-water mark minus RSS at the step's
start (VmHWM reset through /proc/self/clear_refs), counts everything, gloo's own buffers and the
allocator included; it is a cross-check, not the goal's figure. Each step's reduced gradient is
checked to be exactly the expected sum. Last line: `extra_grad_buffers=<max over layouts and
steps of the default mode>` (goal <= 1.0); `--exact` adds exact mode's rows (reported, not in
the goal).

    python bench/memory.py --smoke     # plain only, 200k elements, stale-s 2: seconds (CI)
    python bench/memory.py --quick     # plain and hsdp, default mode
    python bench/memory.py --exact     # + exact mode's rows
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import BENCH_DIR, bench_args, cores, fresh_dir, loadavg, out_dir, say, table
from recover.procs import start, stop, stop_all

log = logging.getLogger("bench.memory")
STEP_NAMES = {1: "failure-free", 2: "recovered (kill mid-reduce)", 3: "after the kill",
              4: "recovered (hang mid-reduce)", 5: "after the hang"}


def scenario(root: Path, layout: str, exact: bool, a: argparse.Namespace) -> list[dict]:
    """Run one coordinator + R replicas; return the surviving ranks' results."""
    nranks = a.shards if layout == "hsdp" else 1
    name = f"{layout}-{'exact' if exact else 'default'}"
    d = fresh_dir(root / name)
    port_file = d / "coordinator.port"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    coord = start([sys.executable, "-m", "recover.control.coordinator", "--replicas",
                   str(a.replicas), "--port", "0", "--port-file", str(port_file), "--stale-s",
                   str(a.stale_s), "--log", str(d / "coordinator.jsonl")], d / "coordinator.log")
    ranks, killed, hung = [], a.replicas - 1, a.replicas - 2
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start; see {d}")
            time.sleep(0.05)
        port = int(port_file.read_text())
        for r in range(a.replicas):
            for k in range(nranks):
                cmd = [sys.executable, str(BENCH_DIR / "_memrank.py"), "--coordinator",
                       f"127.0.0.1:{port}", "--replica", str(r), "--rank", str(k), "--nranks",
                       str(nranks), "--layout", layout, "--numel", str(a.numel), "--kill",
                       f"2:{killed}", "--hang", f"4:{hung}", "--result",
                       str(d / f"r{r}.{k}.json")]
                ranks.append(((r, k), start(cmd + ["--exact"] * exact, d / f"r{r}.{k}.log",
                                            env=env)))
        deadline = time.monotonic() + a.timeout_s
        for (r, k), p in ranks:
            if r in (killed, hung):
                continue  # the hung one stays stopped until stop_all continues and ends it
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{name}: replica {r} rank {k} still running after "
                                   f"{a.timeout_s:.0f}s; see {d}") from None
            if p.returncode != 0:
                raise RuntimeError(f"{name}: replica {r} rank {k} exited {p.returncode}; see "
                                   f"{d / f'r{r}.{k}.log'}")
    finally:
        stop_all([p for _, p in ranks])
        stop(coord)
    return [json.loads((d / f"r{r}.{k}.json").read_text())
            for (r, k), _ in ranks if r not in (killed, hung)]


def main() -> int:
    ap = bench_args(__doc__, "4M elements per rank (< 2 min)", "plain layout only, 200k "
                    "elements per rank, --stale-s 2: the hang is declared sooner")
    ap.add_argument("--layouts", help="default plain,hsdp (plain with --smoke)")
    ap.add_argument("--numel", type=int, help="gradient elements per rank (default 10M; 4M "
                    "with --quick, 200k with --smoke)")
    ap.add_argument("--replicas", type=int, default=4, help="R >= 4 keeps a real collective "
                    "among the survivors of a kill and a hang")
    ap.add_argument("--shards", type=int, default=2, help="ranks per hsdp replica")
    ap.add_argument("--exact", action="store_true", help="also measure exact mode")
    ap.add_argument("--stale-s", type=float, help="coordinator's heartbeat limit (crashes are "
                    "seen by connection loss; it declares the hang; default 5, 2 with --smoke)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="limit per scenario")
    a = ap.parse_args()
    a.numel = a.numel or (200_000 if a.smoke else 4_000_000 if a.quick else 10_000_000)
    a.layouts = a.layouts or ("plain" if a.smoke else "plain,hsdp")
    a.stale_s = a.stale_s or (2.0 if a.smoke else 5.0)
    if a.replicas < 4:
        ap.error("--replicas must be >= 4: with fewer, the survivor of the kill and the hang "
                 "reduces alone")
    root = out_dir(a.out, "memory")
    say(f"memory: extra bytes recover allocates during a step / the rank's gradient bytes; "
        f"{a.numel:,} float32 gradient elements per rank ({a.numel * 4 / 2**20:.0f} MiB), "
        f"R={a.replicas} replicas, N=8; hsdp: {a.shards} shard ranks per replica; out {root}")
    say(f"assumptions: {cores()} CPU core(s), load average {loadavg():.1f}; gloo on 127.0.0.1; "
        "the profiler sees the training thread's torch allocations (recover's buffers are all "
        "made there); the RSS column is the whole process (gloo's buffers, allocator)")
    rows, worst, goal, other = [], None, 0.0, 0.0
    for layout in a.layouts.split(","):
        for exact in (False, True) if a.exact else (False,):
            t0 = time.monotonic()
            res = scenario(root, layout, exact, a)
            mode = "exact" if exact else "default"
            for s in sorted(STEP_NAMES):
                per = [(r["steps"][s], r["grad_bytes"], r) for r in res]
                other = max(other, *(p[0]["other_peak"] / p[1] for p in per))
                step, g, r = max(per, key=lambda x: x[0]["peak"] / x[1])
                x = step["peak"] / g
                rss = [p[0]["rss_delta"] / p[1] for p in per if p[0]["rss_delta"] is not None]
                top = max(step["at_peak"].items(), key=lambda kv: kv[1], default=("-", 0))
                rows.append((layout, mode, STEP_NAMES[s],
                             max(p[0]["attempts"] for p in per), f"{x:.3f}",
                             f"{step['start'] / g:.3f}",
                             f"{max(rss):.2f}" if rss else "n/a",
                             f"{top[0]} ({top[1] / g:.2f})"))
                if not exact:
                    goal = max(goal, x)
                if worst is None or x > worst[0]:
                    worst = (x, layout, mode, STEP_NAMES[s], r["replica"], r["rank"], step, g)
            log.info("%s %s: %.0fs", layout, mode, time.monotonic() - t0)
    say("")
    table(rows, ("layout", "mode", "step", "attempts", "extra peak", "held at start",
                 "RSS peak", "largest at peak (site, grads)"))
    say("  extra peak: recover's live bytes at their peak in the step / gradient bytes (worst "
        "rank); held at start: recover's bytes live when the step began (kept from before); "
        "RSS peak: whole-process high-water mark over the step minus RSS at its start")
    say(f"  allocations on the training thread made outside recover and bench (torch itself): "
        f"at most {other:.3f} gradients live at once")
    if worst is not None:
        x, layout, mode, what, rep, rank, step, gbytes = worst
        say(f"\n  worst: {layout} {mode}, {what}, replica {rep} rank {rank}: {x:.3f} gradients;"
            " live at the peak, by allocation site:")
        for site, b in sorted(step["at_peak"].items(), key=lambda kv: -kv[1]):
            say(f"    {b / 2**20:9.2f} MiB  {b / gbytes:6.3f}  {site}")
    say(f"\ngoal <= 1.0 (default mode); load average now {loadavg():.1f}")
    print(f"extra_grad_buffers={goal:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
