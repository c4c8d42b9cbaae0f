"""`recover bench`: recover vs ckpt-restart vs shrink-batch, one command, one fault schedule.

Invariant: every system runs the same model, data, seed, N and fault schedule, one after another on
this machine, with the real trainer (real processes, real SIGKILLs); only the reaction to a fault
differs. The failure-free reference runs first (the trajectory every deviation is measured
against, and the step time Young-Daly needs). Outputs: DIR/bench.md, DIR/bench.png, DIR/bench.json
(the `recover.app.sim.calibrate` schema); the last line on stdout is
`effective_throughput_ratio=<x>`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from recover.app import rundir
from recover.app.baselines.ckpt_restart import run_ckpt_restart, young_daly_k
from recover.app.baselines.measure import calibration, step_period, summarize
from recover.app.baselines.report import plot, write_md
from recover.app.baselines.runs import SystemRun, dump_runs, measure_ckpt_cost, run_once
from recover.app.baselines.schedule import bench_schedule, describe
from recover.app.config import PRESETS, RunConfig, preset
from recover.app.faults import Fault
from recover.app.sim.calibrate import validation_rows
from recover.errors import HelpFormatter, RecoverError

log = logging.getLogger(__name__)
QUICK = {"replicas": 4, "steps": 20}  # minutes on a small CPU host
# The smallest bench with every part (a kill, a checkpoint restart, a shrunk batch), so CI
# runs it (tests/test_bench.py), and checks its trajectories and the simulator against it.
SMOKE = {"replicas": 2, "steps": 20}
SYSTEMS = ("recover", "ckpt-restart", "shrink-batch")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="recover bench", description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--out", help="output folder (default runs/bench-<time>)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a small run: {QUICK['replicas']} replicas, {QUICK['steps']} steps")
    ap.add_argument("--smoke", action="store_true",
                    help=f"the smallest run: {SMOKE['replicas']} replicas, {SMOKE['steps']} steps, "
                         "one kill (CI runs it)")
    ap.add_argument("--preset", default="debug", choices=tuple(PRESETS),
                    help="the run's named defaults")
    ap.add_argument("--replicas", type=int, help="R at the start (default 8)")
    ap.add_argument("--steps", type=int, help="steps (default: the preset's)")
    ap.add_argument("--kills", type=int, help="replicas killed one by one (default R // 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    ap.add_argument("--data", help="training data (default: the embedded corpus)")
    ap.add_argument("--budget-s", type=float,
                    help="wall-clock budget for 'tokens in budget' (default: reference wall time)")
    ap.add_argument("--target-step", type=int, help="S for 'time to step S' (default 3/4 of steps)")
    return ap


def run_cli(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return _bench(args, argv)
    except RecoverError as e:
        log.error("recover bench: %s", e)
        return 1


def _config(args: argparse.Namespace) -> RunConfig:
    size = SMOKE if args.smoke else QUICK if args.quick else None
    base = preset(args.preset)
    base.layout.replicas = args.replicas or (size["replicas"] if size else 8)
    base.run.steps = args.steps or (size["steps"] if size else base.run.steps)
    base.data.path = args.data
    # join_timeout_s: R processes importing torch on a busy machine take minutes. stale_s: a
    # SIGKILL is seen at once (the liveness socket closes); the heartbeat threshold only catches
    # hangs, and a tight one fires falsely on a host shared with other jobs (a replica "lost"
    # that is alive: docs/MEASUREMENTS.md, "Liveness and detection"), which would give one system
    # an extra fault. Same for every system.
    base = base.replace(ft={"join_timeout_s": 600.0, "stale_s": 5.0})
    base.validate()  # a bad flag is one line before the first run; each launch checks its own
    return base


def _run_systems(base: RunConfig, out: Path, faults: list[Fault]
                 ) -> tuple[SystemRun, dict[str, SystemRun], float, int]:
    """The reference, then each system under `faults`: (reference, runs, checkpoint cost, K)."""
    c_pre = measure_ckpt_cost(base)
    log.info("checkpoint cost (one DCP save, measured in-process): %.3fs", c_pre)
    log.info("running the failure-free reference ...")
    ref = run_once("reference", base, out / "reference", [])
    k = young_daly_k(c_pre, step_period(ref), base.run.steps, len(faults))
    runs = {}
    log.info("running recover ...")
    runs["recover"] = run_once("recover", base, out / "recover", faults)
    log.info("running ckpt-restart (checkpoint every %d steps) ...", k)
    runs["ckpt-restart"] = run_ckpt_restart(base, out / "ckpt-restart", faults, k)
    log.info("running shrink-batch ...")
    runs["shrink-batch"] = run_once("shrink-batch", base, out / "shrink-batch", faults,
                                    policy="shrink-batch")
    return ref, runs, c_pre, k


def _restart_lines(ckpt: SystemRun) -> list[str]:
    return [f"{i + 1}: at step {x['at_step']} -> checkpoint {x['from_checkpoint']} on "
            f"{x['replicas']} replicas: detected in {x['detect_s']:.3f}s; relaunch to first "
            f"step committed {x['first_commit_s']:.1f}s (teardown + coordinator up "
            f"{x['teardown_to_coordinator_s']:.1f}s, replicas started: imports, data, "
            f"checkpoint load {x['replicas_started_s']:.1f}s, rendezvous "
            f"{x['rendezvous_s']:.2f}s, first step {x['first_step_s']:.2f}s); "
            f"{x['redone_steps']} step(s) redone; back where it was {x['total_s']:.1f}s "
            "after the fault"
            for i, x in enumerate(ckpt.extra["restarts"])]


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    base = _config(args)
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    if any((out / s).exists() for s in ("reference", *SYSTEMS)):
        raise RecoverError(f"{out} already holds a bench; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    faults = bench_schedule(base.layout.replicas, base.run.steps, args.seed, args.kills)
    print(f"fault schedule (seed {args.seed}): {describe(faults)}", flush=True)
    t_bench, load0 = time.time(), os.getloadavg()[0]
    ref, runs, c_pre, k = _run_systems(base, out, faults)
    step_s = step_period(ref)
    budget = args.budget_s or ref.wall_s
    target = min(base.run.steps, args.target_step or max(1, (3 * base.run.steps) // 4))
    rows = [summarize(r, ref, budget, target) for r in (*runs.values(), ref)]
    dump_runs(out / rundir.BENCH_RUNS, [*runs.values(), ref])
    calib = calibration(runs, ref, faults, c_pre)
    (out / rundir.BENCH_CALIBRATION).write_text(json.dumps(calib, indent=2) + "\n")
    validation = validation_rows(calib)
    pooled = validation_rows({k: v for k, v in calib.items() if k != "per_system"})
    ratio = rows[0]["effective_throughput"] / rows[1]["effective_throughput"]
    ratio_incl = (rows[0]["effective_throughput_incl_startup"]
                  / rows[1]["effective_throughput_incl_startup"])
    info = {"command": "recover bench " + " ".join(argv), "replicas": base.layout.replicas,
            "microbatches": base.data.microbatches, "microbatch_size": base.data.microbatch_size,
            "block_size": base.model.block_size, "steps": base.run.steps, "preset": args.preset,
            "seed": args.seed, "cores": os.cpu_count(),
            "load": (load0, os.getloadavg()[0]), "schedule": describe(faults),
            "ckpt_every": k, "ckpt_cost_pre_s": c_pre, "ckpt_cost_s": calib["ckpt_cost_s"],
            "mtbf_s": base.run.steps * step_s / max(1, len(faults)), "step_time_s": step_s,
            "kills": len(faults), "budget_s": budget, "target_step": target,
            "restart_lines": _restart_lines(runs["ckpt-restart"]), "ratio": ratio,
            "ratio_incl_startup": ratio_incl}
    write_md(out / rundir.BENCH_TABLE, rows, info, validation, pooled)
    plot(out / rundir.BENCH_PLOT, [*runs.values(), ref])
    _print_results(rows, validation)
    log.info("done in %.0fs; %s, %s", time.time() - t_bench, out / rundir.BENCH_TABLE,
             out / rundir.BENCH_PLOT)
    print(f"effective_throughput_ratio_incl_startup={ratio_incl:.3f}", flush=True)
    print(f"effective_throughput_ratio={ratio:.3f}", flush=True)
    return 0


def _print_results(rows: list[dict], validation: list[tuple[str, float, float, float]]) -> None:
    """The bench's result lines (stdout): each system's figures, the simulator's predictions."""
    for r in rows:
        print(f"{r['system']:>13}: wall {r['wall_s']:6.1f}s (+{r['startup_s']:.1f}s startup)  "
              f"steps {r['steps']}  eff. throughput {r['effective_throughput']:6.2f} mb/s  "
              f"lost mb {r['lost_microbatches']}  "
              f"max rel dev {r['max_rel_dev']:.1e}", flush=True)
    for name, pred, meas, err in validation:
        print(f"simulator {name:>13}: predicted {pred:6.1f}s  measured {meas:6.1f}s  "
              f"error {100 * err:5.1f}%", flush=True)
