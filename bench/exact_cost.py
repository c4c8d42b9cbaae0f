"""Exact mode's cost: step time and memory of `recover train --exact` vs the default mode, ABBA.

What: for each preset (debug, small), whole `recover train` runs (launcher, coordinator, R
replica processes, no faults) in the default mode (A) and with `--exact` (B), in ABBA order so
that drift and other load on the machine hit both alike: per-step time (commit to commit, from
the metrics' `time_s`, after --warmup steps), CPU seconds per step (every worker's and the
coordinator's own clocks, robust to other load), and memory (each worker's resident-set
high-water mark, VmHWM, sampled from /proc while it runs; the difference between the modes is
what exact mode adds, shown in MiB and in units of the model's fp32 gradient). Equal quotas in
both modes (equal quotas, the default), so both compute the same microbatches on the same replicas.
Where exact mode's extra bytes come from, allocation by allocation: `bench/memory.py --exact`.
Last lines: `exact_step_time_ratio_<preset>=` for each, then `exact_step_time_ratio=<max>`
(goal <= 1.10).

    python bench/exact_cost.py --smoke     # debug only, R=2, one A and one B run of 8 steps (CI)
    python bench/exact_cost.py --quick     # R=2, one ABBA round, < 4 min on 2 cores
    python bench/exact_cost.py             # R=min(4, cores), two ABBA rounds, more steps
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from _common import bench_args, cores, loadavg, median, out_dir, periods, recover_train, say, table

log = logging.getLogger("bench.exact_cost")
GOAL = 1.10


def grad_bytes(preset_name: str) -> int:
    """Bytes of the model's fp32 gradient (one per trainable parameter)."""
    from recover.app.config import preset
    from recover.app.train.model import build_model

    cfg = preset(preset_name)
    model = build_model(cfg.model, cfg.run.seed)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def measure(root: Path, name: str, steps: int, a: argparse.Namespace) -> float:
    """ABBA runs of one preset; print their table and ratios; return the step-time ratio."""
    flags = ["--replicas", str(a.replicas), "--steps", str(steps), "--eval-every", "0",
             "--stale-s", str(a.stale_s)]
    order = ([m for _ in range(a.rounds) for m in ("default", "exact", "exact", "default")]
             if not a.smoke else ["default", "exact"])  # --smoke: one pair, side by side
    per: dict[str, list[float]] = {"default": [], "exact": []}
    meds: list[tuple[str, float]] = []
    cpu: dict[str, list[float]] = {"default": [], "exact": []}
    rss: dict[str, list[int]] = {"default": [], "exact": []}
    rows = []
    for i, mode in enumerate(order):
        t0, load0 = time.monotonic(), loadavg()
        recs, smp = recover_train(root / f"{name}-{i}-{mode}", name,
                                  flags + ["--exact"] * (mode == "exact"), a.timeout_s)
        if any(r["generation"] != 0 for r in recs):
            log.warning("%s run %d: the membership changed in a failure-free run (a false "
                        "alarm under load); its steps still count", name, i)
        p = periods(recs, a.warmup, steps)
        c = smp.per_step(a.warmup, steps)[0]
        peak = max(smp.peak_rss.values(), default=0)
        per[mode] += p
        meds.append((mode, median(p)))
        cpu[mode].append(c)
        rss[mode].append(peak)
        rows.append((name, i, mode, len(p), f"{median(p) * 1e3:.1f}", f"{c * 1e3:.1f}",
                     f"{peak / 2**20:.0f}", f"{load0:.1f}", f"{time.monotonic() - t0:.0f}"))
    table(rows, ("preset", "run", "mode", "steps", "median step ms", "CPU ms/step",
                 "peak RSS MiB", "load avg", "wall s"))
    ratio = median(per["exact"]) / median(per["default"])
    # Adjacent A/B runs (AB and BA of each ABBA) as pairs: the noise between them is smallest.
    pairs = [meds[k + 1][1] / meds[k][1] if meds[k][0] == "default" else
             meds[k][1] / meds[k + 1][1] for k in range(0, len(meds) - 1, 2)]
    cpu_ratio = median(cpu["exact"]) / median(cpu["default"])
    g = grad_bytes(name)
    extra = median([float(x) for x in rss["exact"]]) - median([float(x) for x in rss["default"]])
    say(f"  {name}: median step exact {median(per['exact']) * 1e3:.1f} ms / default "
        f"{median(per['default']) * 1e3:.1f} ms = {ratio:.3f} (adjacent pairs: "
        f"{', '.join(f'{x:.3f}' for x in pairs)}); CPU per step {cpu_ratio:.3f}; peak RSS per "
        f"worker +{extra / 2**20:.1f} MiB = {extra / g:+.1f} x the fp32 gradient "
        f"({g / 2**20:.2f} MiB)")
    return ratio


def main() -> int:
    ap = bench_args(__doc__, "R=2, one ABBA round, fewer steps", "debug preset, R=2, one "
                    "default and one exact run of 8 steps")
    ap.add_argument("--presets", help="default debug,small (debug with --smoke)")
    ap.add_argument("--replicas", type=int, help="default 2 with --quick, else min(4, cores)")
    ap.add_argument("--steps", type=int, help="steps per run (default: debug 40 / small 16 "
                    "with --quick, 120 / 50 without)")
    ap.add_argument("--rounds", type=int, help="ABBA rounds (default 1 with --quick, else 2)")
    ap.add_argument("--warmup", type=int, help="leading steps not timed (default 4; 2 smoke)")
    ap.add_argument("--stale-s", type=float, default=5.0, help="heartbeat limit (no per-step "
                    "cost; avoids false alarms on an overloaded machine)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per run")
    a = ap.parse_args()
    quick = a.quick or a.smoke
    a.replicas = a.replicas or (2 if quick else min(4, cores()))
    a.rounds = a.rounds or (1 if quick else 2)
    a.presets = a.presets or ("debug" if a.smoke else "debug,small")
    a.warmup = a.warmup if a.warmup is not None else (2 if a.smoke else 4)
    root = out_dir(a.out, "exact-cost")
    say(f"exact cost: `recover train --exact` vs the default mode, R={a.replicas}, "
        + ("one AB pair" if a.smoke else f"ABBA x {a.rounds}")
        + f", equal quotas, eval off; out {root}")
    say(f"assumptions: {cores()} CPU core(s), load average {loadavg():.1f}; one intra-op thread "
        "per process; a step = commit to commit (metrics time_s) after the first "
        f"{a.warmup}; memory = each worker's VmHWM (whole process)")
    ratios = {}
    for name in a.presets.split(","):
        steps = a.steps or (8 if a.smoke else {True: {"debug": 40, "small": 16},
                                               False: {"debug": 120, "small": 50}}[quick]
                            .get(name, 40))
        ratios[name] = measure(root, name, steps, a)
    say(f"\ngoal: step time <= {GOAL}x the default mode; load average now {loadavg():.1f} on "
        f"{cores()} core(s)" + (" (wall times on an overloaded machine are noisy; the CPU "
                                "ratios are robust to it)" if loadavg() > cores() else ""))
    for name, r in ratios.items():
        print(f"exact_step_time_ratio_{name}={r:.3f}")
    print(f"exact_step_time_ratio={max(ratios.values()):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
