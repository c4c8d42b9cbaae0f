"""Failure-free overhead of recover's trainer against plain PyTorch DDP, measured side by side.

What: time per optimizer step of recover (coordinator + R replica processes running the
unmodified `recover.app.train.worker`, fault tolerance on, no faults) divided by that of
`DistributedDataParallel` with `no_sync` gradient accumulation (`bench/_ddp.py`) on the same
model, data, microbatch ids, N, B, R, optimizer and clipping; one process per replica, gloo, one
intra-op thread each.

How: the same R processes alternate blocks of --block recover steps and --block DDP steps (DDP
on its own process group), so drift and other load on the machine hit both alike; both are timed
by the same clocks around the whole loop (recover: engine.run + the worker's optimizer and
record; DDP: lr..optimizer). `bench/_profile.py` breaks recover's step into compute, reduce,
collective, group build and commit decision from the library's public counters
(`StepEngine.stats`, `FaultTolerantComm.stats`), and counts store round-trips with a wrapper
around the store client; CPU clocks (robust to other load) give a second ratio that includes the
coordinator's share. Each ratio is the median of the recover/DDP ratios of the run's pairs of
adjacent blocks (recover then DDP, DDP then recover, ...: AB BA AB, so a drift of the machine's
speed raises as many of them as it lowers), every replica's steps counted; the range of the
pairs is printed on a line of its own before it. With --separate (default outside --quick),
whole `recover train` runs (launcher included) and standalone DDP runs are also compared in ABBA
order. Last lines, for each preset but debug (`_small` for the small preset), then for debug:
`cpu_overhead_ratio_spread=<lo>..<hi> n=<pairs>`, `cpu_overhead_ratio=<x>`,
`overhead_ratio_spread=<lo>..<hi> n=<pairs>`, `overhead_ratio=<recover/ddp wall>`
(goals: debug <= 1.03, small <= 1.00).

    python bench/overhead.py --smoke          # debug preset, R=2, 12 steps: seconds (CI)
    python bench/overhead.py --quick          # small + debug presets, R=4, one interleaved run each
    python bench/overhead.py                  # both presets, more steps, + separate runs
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

from _common import (
    BENCH_DIR,
    bench_args,
    cores,
    defaults,
    field,
    fresh_dir,
    loadavg,
    median,
    out_dir,
    periods,
    recover_train,
    say,
    table,
)
from _overhead_report import report
from _profile import profiled_run
from recover.app.config import preset
from recover.app.train.prepared import prepare_run
from recover.procs import start, stop_all

log = logging.getLogger("bench.overhead")
# --smoke: one interleaved run, as small as still times recover and DDP blocks side by side.
SMOKE = {"replicas": 2, "block": 2, "warmup": 2, "presets": "debug"}


def ddp_run(cfg, run: Path, bucket_mb: float, timeout_s: float) -> list[dict]:
    cfg = cfg.replace(run={"out": str(fresh_dir(run))})  # a reused --out's run is refused
    prepare_run(cfg)
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        for r in range(cfg.layout.replicas):
            procs.append(start(
                [sys.executable, str(BENCH_DIR / "_ddp.py"), "--run-dir", str(run), "--rank",
                 str(r), "--world", str(cfg.layout.replicas), "--store-file",
                 str(run / "filestore"),
                 "--result", str(run / f"rank{r}.json"), "--bucket-mb", str(bucket_mb)],
                run / f"rank{r}.log", env=env))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"DDP ranks exited {[p.returncode for p in procs]}; see {run}")
    finally:
        stop_all(procs)
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(cfg.layout.replicas)]


def ddp_periods(rec: dict, lo: int, hi: int) -> list[float]:
    e = rec["end"]
    return [e[s] - e[s - 1] for s in range(max(lo, 1), min(hi, len(e)))]


def separate(cfg, name: str, root: Path, a, steps: int, flags: list[str]) -> float:
    """`recover train` runs vs standalone DDP runs in ABBA order; return the wall ratio."""
    rows, rec_all, ddp_all = [], [], []
    lo, hi = a.warmup, steps
    for k in range(a.rounds):
        for kind in (("recover", "ddp") if k % 2 == 0 else ("ddp", "recover")):
            t0, load0 = time.monotonic(), loadavg()
            if kind == "recover":
                recs, smp = recover_train(root / f"recover{k}", name, flags, a.timeout_s)
                per = periods(recs, lo, hi)
                own = field(recs, "step_time_s", lo, hi)
                c = smp.per_step(lo, hi)[0]
                if recs[-1]["generation"] != 0:
                    log.warning("membership changed in a failure-free run (false alarm)")
                rec_all += per
            else:
                d = ddp_run(cfg, root / f"ddp{k}", a.bucket_mb, a.timeout_s)
                per = ddp_periods(d[0], lo, hi)
                own = d[0]["step_s"][lo:]
                c = sum((r["cpu"][hi - 1] - r["cpu"][lo - 1]) / (hi - lo) for r in d)
                ddp_all += per
            rows.append((kind, k, len(per), f"{median(per) * 1e3:.1f}",
                         f"{median(own) * 1e3:.1f}", f"{c * 1e3:.1f}", f"{load0:.1f}",
                         f"{time.monotonic() - t0:.1f}"))
    table(rows, ("run", "round", "steps", "median step ms", "own timer ms", "CPU ms/step",
                 "load avg", "wall s"))
    say("  CPU ms/step: all replica processes (+ the coordinator for recover), own clocks")
    ratio = median(rec_all) / median(ddp_all)
    say(f"  separate runs: recover {median(rec_all) * 1e3:.2f} ms/step, DDP "
        f"{median(ddp_all) * 1e3:.2f} ms/step -> ratio {ratio:.3f}")
    return ratio


def parse_args() -> argparse.Namespace:
    ap = bench_args(__doc__, "small and debug presets, one interleaved run each (< 5 min)",
                    "debug preset, R=2, 12 steps in blocks of 2, no separate runs")
    ap.add_argument("--presets", help="model/data presets, comma-separated (default small,debug;"
                    " debug with --smoke); `overhead_ratio=` is debug's, the others' get a "
                    "suffix (`overhead_ratio_small=`)")
    ap.add_argument("--replicas", type=int, help="R (default 4; 2 with --smoke)")
    ap.add_argument("--steps", type=int, help="recover steps (and as many DDP steps); default "
                    "debug 60 / small 30 with --quick, 120 / 60 without, 12 with --smoke")
    ap.add_argument("--block", type=int, help="steps per recover/DDP block (default 5; 2 smoke)")
    ap.add_argument("--warmup", type=int, help="leading recover steps not timed (default 5; 2 "
                    "smoke)")
    ap.add_argument("--separate", action=argparse.BooleanOptionalAction, default=None,
                    help="also compare whole `recover train` runs with standalone DDP runs "
                         "(ABBA); default on, off with --quick")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds of --separate")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    ap.add_argument("--speed-aware", action="store_true",
                    help="speed-aware quotas in recover (default: equal quotas)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="limit per run")
    ap.add_argument("--stale-s", type=float, default=5.0,
                    help="recover's heartbeat staleness threshold (no per-step cost; the default"
                         " 1.0 s gave false alarms on a machine loaded far beyond its cores)")
    a = ap.parse_args()
    full = {"replicas": 4, "block": 5, "warmup": 5, "presets": "small,debug"}
    defaults(a, SMOKE if a.smoke else full)
    a.quick = a.quick or a.smoke
    # A small step costs ~8 debug steps: half as many keep its run about as long.
    per = {"debug": 60, "small": 30} if a.quick else {"debug": 120, "small": 60}
    a.steps_of = {n: a.steps or (12 if a.smoke else per.get(n, per["debug"]))
                  for n in a.presets.split(",")}
    a.sep = (not a.quick) if a.separate is None else a.separate
    return a


def interleaved(name: str, a: argparse.Namespace, root: Path) -> tuple[list[float], list[float]]:
    """One interleaved run of preset `name`; its report; the (wall, CPU) ratios of its pairs."""
    cfg = preset(name)
    cfg.layout.replicas, cfg.run.steps = a.replicas, a.steps_of[name]
    cfg.data.eval_every = 0
    cfg.run.out = str(fresh_dir(root / f"interleaved-{name}"))  # a reused --out's is refused
    cfg = cfg.replace(ft={"stale_s": a.stale_s, "speed_aware": a.speed_aware})
    m = cfg.model
    say(f"\noverhead: recover vs DDP(no_sync), preset {name}: d={m.n_embd} L={m.n_layer} "
        f"T={m.block_size}, N={cfg.data.microbatches} B={cfg.data.microbatch_size} "
        f"R={cfg.layout.replicas}; {cfg.run.steps} recover steps interleaved with DDP in blocks "
        f"of {a.block}; out {root}")
    say(f"assumptions: {cores()} CPU core(s) for {cfg.layout.replicas} replica processes + the "
        f"coordinator (load average now {loadavg():.1f}); torch.set_num_threads(1); gloo on "
        f"127.0.0.1; eval/checkpoint only after the last step; DDP bucket_cap_mb={a.bucket_mb}, "
        f"gradient_as_bucket_view=True; a step = the whole loop (recover: commit to commit incl. "
        f"the step record; DDP: lr..optimizer); first {a.warmup} recover steps, DDP's first "
        f"block and the first step of every block untimed; recover --stale-s {a.stale_s} (no "
        f"per-step cost); recover speed-aware quotas: {cfg.ft.speed_aware}")
    say("interleaved: the unmodified recover worker in R processes, each also running DDP "
        "blocks between recover's steps, so noise and load hit both alike; recover's phases "
        "come from the library's public counters (bench/_profile.py)")
    t0 = time.monotonic()
    reps, coord = profiled_run(cfg, a.timeout_s, a.block, a.bucket_mb)
    pairs = report(reps, coord, a.warmup, a.block)
    say(f"  ({time.monotonic() - t0:.0f}s wall)")
    if a.sep:
        say("\nseparate runs: `recover train` (launcher + coordinator + workers) vs "
            "bench/_ddp.py, ABBA")
        flags = ["--replicas", str(cfg.layout.replicas), "--steps", str(cfg.run.steps),
                 "--eval-every", "0", "--stale-s", str(a.stale_s)]
        flags += ["--speed-aware"] * a.speed_aware
        separate(cfg, name, root / name, a, cfg.run.steps, flags)
    return pairs


def main() -> int:
    a = parse_args()
    names = a.presets.split(",")
    root = out_dir(a.out, "overhead")
    results = {name: interleaved(name, a, root) for name in names}
    say(f"\ngoals: overhead_ratio (debug) <= 1.03, overhead_ratio_small <= 1.00; each ratio is "
        f"the median of the recover/DDP ratios of adjacent blocks (AB BA AB ...) in one run; "
        f"load average now {loadavg():.1f} on {cores()} core(s)"
        + (" -- wall times on an overloaded machine reflect the scheduler's sharing"
           if loadavg() > cores() else ""))
    # The headline preset (debug where measured) last: `overhead_ratio=` is the last line.
    head = "debug" if "debug" in results else names[-1]
    for name in [n for n in names if n != head] + [head]:
        wall, cpu = results[name]
        tail = "" if name == head else f"_{name}"
        print(f"cpu_overhead_ratio{tail}_spread={min(cpu):.3f}..{max(cpu):.3f} n={len(cpu)}")
        print(f"cpu_overhead_ratio{tail}={median(cpu):.3f}")
        print(f"overhead_ratio{tail}_spread={min(wall):.3f}..{max(wall):.3f} n={len(wall)}")
        print(f"overhead_ratio{tail}={median(wall):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
