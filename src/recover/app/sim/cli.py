"""`recover simulate`: command line of the cluster simulator.

Invariant: user mistakes (bad flag, negative value, missing or malformed file, GPUs not divisible
into replicas) end as one `recover simulate: error: ...` line on stderr and exit status 2, never a
traceback; a run ends with exactly two lines, `throughput_ratio=<x>` and
`extra_tokens_pct_at_234_gpu_hours=<y>` (definitions in
`recover.app.sim.results`), printed after every
assumption they rest on. `--scenario scale` is its own run (`recover.app.sim.scale_report`), ending
with `ettr_recover_at_100k=<x>`.

Precedence of parameters: SimParams defaults < `--scenario paper` < `--calibrate bench.json` <
explicit flags. With `--calibrate` alone the bench's own run (replicas, N, steps, fault steps) is
simulated and compared with its measured wall times; with `--scenario paper` only the bench's
measured costs (checkpoint, restart, detection, rebuild) are carried over.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from recover.app.sim.calibrate import COST_KEYS, calib_params, load_calibration, validation_rows
from recover.app.sim.curve import FIT_MODES
from recover.app.sim.faults import build_schedule
from recover.app.sim.flags import FLAGS, SCENARIO_OWNS, non_negative
from recover.app.sim.params import POLICIES, SimParams
from recover.app.sim.report import assumptions, fmt, table, throughput_lines, write_outputs
from recover.app.sim.scale_report import run_scale_cli
from recover.app.sim.scenario import (
    PAPER_GPU_HOURS,
    ScenarioSpec,
    paper_base,
    pooled,
    scenario_params,
)
from recover.app.sim.sensitivity import paper_thresholds, sensitivity_rows
from recover.errors import ConfigError, HelpFormatter, RecoverError

SCALE_ONLY = ("quick", "sizes", "curve", "curve_fit", "rebuild", "control")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="recover simulate",
        argument_default=argparse.SUPPRESS,  # unset: the precedence above decides
        formatter_class=HelpFormatter,
        description="Discrete-event simulation of pre-training under failures: recover "
        "vs ckpt-restart vs shrink-batch on the same failure sequence.",
    )
    for name, (parse, hlp) in FLAGS.items():
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=parse, help=hlp)
    add = ap.add_argument
    add("--scenario", choices=["paper", "scale"],
        help="paper: 512 GPUs, 256 lost over the run; scale: ETTR from 1,024 to 131,072 GPUs")
    add("--fault-every-min", type=non_negative(float),
        help="scenario: mean minutes between replica losses (default 10)")
    add("--fault-schedule", choices=["random", "even"],
        help="scenario: seeded uniform times (default) or evenly spaced")
    add("--lost-gpus", type=non_negative(int), help="scenario: GPUs lost (default 256)")
    add("--seeds", type=non_negative(int), help="scenario: schedules pooled (default 10)")
    add("--calibrate", metavar="BENCH_JSON", help="parameters measured by recover bench")
    add("--quick", action="store_true", help="scale: 4 sizes, 48 h, 1 seed")
    add("--sizes", type=_sizes, help="scale: comma-separated GPU counts (default 1,024..131,072)")
    add("--curve", metavar="JSON", help="scale: recover's measured scale curve (default shipped)")
    add("--curve-fit", choices=list(FIT_MODES),
        help="scale: extrapolation of the curve (default mixed; see recover.app.sim.curve)")
    add("--rebuild", choices=["cpu", "wall"],
        help="scale: recover's rebuild per group member: the measured CPU time (default, "
        "contention-free) or the measured wall clock (2 cores shared by every rank)")
    add("--control", choices=["cpu", "one-store", "wall"],
        help="scale: recover's control plane per step: a rank's CPU + the store shards' serial "
        "work (default), the same on one store server, or the wall clock measured on 2 cores")
    add("--plot", metavar="PNG", help="plot (paper: tokens vs GPU-hours; scale: ETTR vs GPUs)")
    add("--sensitivity", action="store_true", help="vary MTTF, ckpt interval, restart")
    add("--out", metavar="DIR", help="write results.json (and the plot) there")
    return ap


def _sizes(s: str) -> tuple[int, ...]:
    sizes = tuple(sorted({non_negative(int)(x) for x in s.split(",") if x.strip()}))
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected GPU counts >= 1, got {s!r}")
    return sizes


def run_cli(argv: list[str]) -> int:
    """`recover simulate ARGS`; returns the exit status (2 on bad input)."""
    try:
        return _run(argv)
    except RecoverError as e:
        print(f"recover simulate: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0) if not isinstance(e.code, str) else 2


def _run(argv: list[str]) -> int:
    a = vars(build_parser().parse_args(argv))
    flags = {k: v for k, v in a.items() if k in FLAGS}
    if a.get("scenario") == "scale":
        return run_scale_cli(a, flags)
    scenario = a.get("scenario") == "paper"
    base, spec, calib = _checked_inputs(a, flags, scenario)
    seeds = spec.seeds if scenario else int(a.get("seeds", 1))

    def build(seed: int, over: dict[str, Any] | None = None) -> SimParams:
        over = dict(over or {})
        every = over.pop("fault_every_min", spec.fault_every_min)
        p = replace(base, **over)
        if scenario:
            return scenario_params(p, replace(spec, fault_every_min=every), seed)
        return replace(p, seed=base.seed + seed)

    gh = PAPER_GPU_HOURS
    pr = pooled(lambda s: build(s), seeds, gh, POLICIES)
    p0 = pr.first_params or base
    _print_run(pr, p0, spec if scenario else None, seeds, calib)
    if a.get("sensitivity"):
        print()
        every = spec.fault_every_min if scenario else None
        for line in sensitivity_rows(build, seeds, gh, every):
            print(line)
        if scenario:
            for line in paper_thresholds(build, seeds, gh, spec.fault_every_min, p0.restart_cost_s):
                print(line)
    out = a.get("out")
    png = a.get("plot") or (str(Path(out) / "tokens_vs_gpu_hours.png") if out else None)
    for line in write_outputs(pr.first, png, out, gh, pr.ratio, pr.extra_pct, p0):
        print(line)
    print(f"throughput_ratio={fmt(pr.ratio, 3).replace(',', '')}")
    print(f"extra_tokens_pct_at_234_gpu_hours={fmt(pr.extra_pct, 1).replace(',', '')}")
    return 0


def _checked_inputs(a: dict[str, Any], flags: dict[str, Any],
                    scenario: bool) -> tuple[SimParams, ScenarioSpec, dict[str, Any] | None]:
    """The run's parameters, scenario and calibration from the parsed flags, checked."""
    for key in SCALE_ONLY:
        if a.get(key, False) is not False:  # store_true options are always present
            raise ConfigError(f"--{key.replace('_', '-')} needs --scenario scale")
    base = paper_base() if scenario else SimParams()
    calib = load_calibration(a["calibrate"]) if "calibrate" in a else None
    if calib is not None:
        base = (
            replace(base, **{k: float(calib[k]) for k in COST_KEYS if k in calib})
            if scenario
            else calib_params(calib)
        )
    clash = [k for k in SCENARIO_OWNS if k in flags]
    if scenario and clash:
        flag = "--" + clash[0].replace("_", "-")
        raise ConfigError(
            f"--scenario paper schedules its own failures and run length; drop {flag}"
        )
    base = replace(base, **flags)
    # The scenario sets the run's end itself; check everything else now, the rest in simulate().
    replace(base, budget_h=1.0 if scenario else base.budget_h).validate()
    if base.gpus_per_replica > 0 and "lost_gpus" in a and a["lost_gpus"] % base.gpus_per_replica:
        raise ConfigError("lost-gpus must be a multiple of gpus-per-replica")
    spec = ScenarioSpec()
    for key in ("fault_every_min", "lost_gpus", "seeds"):
        if key in a:
            setattr(spec, key, a[key])
    spec.schedule = a.get("fault_schedule", spec.schedule)
    if spec.fault_every_min <= 0:
        raise ConfigError("fault-every-min must be > 0")
    if not 1 <= a.get("seeds", 1) <= 1000:
        raise ConfigError("seeds must be within 1..1000")
    if scenario and spec.lost_gpus // base.gpus_per_replica >= base.replicas:
        raise ConfigError("lost-gpus must leave at least one replica")
    return base, spec, calib


def _print_run(pr: Any, p0: SimParams, spec: ScenarioSpec | None, seeds: int,
               calib: dict[str, Any] | None) -> None:
    """The run's header, assumptions, table and per-seed spread (CLI output)."""
    gh = PAPER_GPU_HOURS
    res, sched = pr.first, build_schedule(p0)
    print("recover simulate: recover vs ckpt-restart vs shrink-batch on one failure sequence")
    if spec is not None:
        print(
            f"scenario: paper (ReCoVer, arXiv 2605.11215): {p0.gpus} GPUs, {spec.lost_gpus} "
            f"lost over the run, a loss every {fmt(spec.fault_every_min, 1)} min on average "
            f"({spec.schedule} times); figures pooled over seeds 0..{seeds - 1}; table and plot "
            "show seed 0"
        )
    print("assumptions:")
    for line in assumptions(p0, sched):
        print("  " + line)
    print(
        "  throughput_ratio: recover / ckpt-restart committed tokens per second from the first "
        "replica loss to the end of the run"
    )
    print(
        f"  extra_tokens_pct_at_{gh:g}_gpu_hours: 100*(recover/ckpt-restart - 1) of committed "
        f"(trajectory) tokens when each has consumed {gh:g} GPU-hours"
    )
    print()
    for line in table(res) + throughput_lines(res):
        print(line)
    if calib is not None and spec is None:
        print()
        print(f"{'validation':<13}{'predicted s':>13}{'measured s':>13}{'error':>9}")
        for name, pred, meas, err in validation_rows(calib):
            print(f"{name:<13}{pred:>13.2f}{meas:>13.2f}{100 * err:>8.1f}%")
    if seeds > 1:
        print()
        for i, what in ((0, "throughput_ratio"), (1, f"extra_tokens_pct_at_{gh:g}_gpu_hours")):
            v = sorted(x[i] for x in pr.per_seed)
            print(
                f"per-seed {what}: min {fmt(v[0])}, median {fmt(v[len(v) // 2])}, max {fmt(v[-1])}"
            )
