"""Sensitivity of recover's advantage over ckpt-restart to the failure rate, checkpoint interval,
restart cost and checkpoint cost, and the values of each knob at which the paper's figures would be
reached.

Invariant: each row changes one knob of the base run and nothing else (same seeds, same costs); the
figures are pooled over the same seeds as the headline figures (see `scenario.pooled`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from recover.app.sim.faults import build_schedule
from recover.app.sim.params import LLAMA3_PER_GPU_MTTF_H, SimParams, young_daly_steps
from recover.app.sim.report import fmt
from recover.app.sim.scenario import PAPER_EXTRA_PCT, PAPER_RATIO, pooled

#: build(seed, overrides) -> SimParams; overrides: fault_every_min (scenario), per_gpu_mttf_h,
#: ckpt_interval_steps, restart_cost_s.
Builder = Callable[[int, dict[str, Any]], SimParams]

FAULT_EVERY_MIN = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 240.0)
MTTF_FACTORS = (0.001, 0.01, 0.1, 1.0, 10.0)
CKPT_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
RESTART_S = (30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
CKPT_COST_S = (5.0, 15.0, 60.0, 180.0)


def _measure(build: Builder, over: dict[str, Any], seeds: int, gh: float) -> tuple[float, float]:
    pr = pooled(lambda s: build(s, over), seeds, gh)
    return pr.ratio, pr.extra_pct


def sensitivity_rows(
    build: Builder, seeds: int, gpu_hours: float, scenario_every_min: float | None
) -> list[str]:
    """The table as text lines; `scenario_every_min` set: the failure knob is the loss interval."""
    base = build(0, {})
    gpus = base.gpus
    sched = build_schedule(base)
    k0 = base.ckpt_interval_steps or young_daly_steps(
        base.ckpt_cost_s, sched.mtbf_s(gpus), base.step_time_s
    )
    base_ratio, base_extra = _measure(build, {}, seeds, gpu_hours)
    rows: list[tuple[str, dict[str, Any], str]] = []
    if scenario_every_min is not None:
        llama_min = LLAMA3_PER_GPU_MTTF_H * 60.0 / gpus
        for f in (*FAULT_EVERY_MIN, llama_min):
            tag = " (Llama 3 rate)" if f == llama_min else ""
            rows.append(
                (
                    "loss every",
                    {"fault_every_min": f},
                    f"{fmt(f, 0)} min = per-GPU MTTF {fmt(f / 60 * gpus, 0)} h{tag}",
                )
            )
    elif sched.per_gpu_mttf_s is not None:
        for x in MTTF_FACTORS:
            m = (base.per_gpu_mttf_h or 0.0) * x
            rows.append(
                (
                    "per-GPU MTTF",
                    {"per_gpu_mttf_h": m},
                    f"{fmt(m, 0)} h = job MTBF {fmt(m * 60 / gpus, 1)} min",
                )
            )
    for x in CKPT_FACTORS:
        k = max(1, round(k0 * x))
        rows.append(
            (
                "ckpt interval",
                {"ckpt_interval_steps": k},
                f"fixed {k:,} steps ({x:g} x Young-Daly at the start)",
            )
        )
    for c in RESTART_S:
        rows.append(("restart cost", {"restart_cost_s": c}, f"{fmt(c, 0)} s"))
    for c in CKPT_COST_S:
        rows.append(("ckpt cost", {"ckpt_cost_s": c}, f"{fmt(c, 0)} s per checkpoint"))
    head = f"{'knob':<15}{'value':<52}{'ratio':>8}{'extra %':>10}  where the advantage"
    out = [
        f"sensitivity (each row changes one knob; pooled over {seeds} seed(s); base: "
        f"throughput_ratio {fmt(base_ratio)}, extra tokens {fmt(base_extra, 1)}% at "
        f"{gpu_hours:g} GPU-h)",
        head,
        "-" * len(head),
    ]
    for knob, over, label in rows:
        ratio, extra = _measure(build, over, seeds, gpu_hours)
        out.append(f"{knob:<15}{label:<52}{fmt(ratio):>8}{fmt(extra, 1):>10}  {_verdict(ratio)}")
    return out


def _verdict(ratio: float) -> str:
    if math.isnan(ratio):
        return "n/a (no fault in the run)"
    if ratio < 1.05:
        return "vanishes (< 1.05x)"
    if ratio < 1.5:
        return "small"
    return "large" if ratio < PAPER_RATIO else f"reaches the paper's {PAPER_RATIO}x"


def solve(
    build: Builder,
    key: str,
    lo: float,
    hi: float,
    target: float,
    which: int,
    seeds: int,
    gpu_hours: float,
    iters: int = 14,
) -> str:
    """The value of knob `key` in [lo, hi] where figure `which` (0 ratio, 1 extra %) hits `target`.

    Geometric bisection; assumes the figure is monotone in the knob (it is, up to seed noise).
    """

    def f(x: float) -> float:
        return _measure(build, {key: x}, seeds, gpu_hours)[which] - target

    flo, fhi = f(lo), f(hi)
    if math.isnan(flo) or math.isnan(fhi) or (flo > 0) == (fhi > 0):
        return f"not within {fmt(lo, 0)}..{fmt(hi, 0)}"
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        fm = f(mid)
        if (fm > 0) == (flo > 0):
            lo, flo = mid, fm
        else:
            hi = mid
    return fmt(math.sqrt(lo * hi), 1)


def paper_thresholds(
    build: Builder, seeds: int, gpu_hours: float, every_min: float, restart_s: float
) -> list[str]:
    """Which restart cost (at the base loss interval) or loss interval (at the base restart cost)
    gives exactly the paper's 2.23x and +74.9%."""
    lines = []
    for which, target, what in (
        (0, PAPER_RATIO, f"throughput_ratio = {PAPER_RATIO}"),
        (1, PAPER_EXTRA_PCT, f"extra tokens = {PAPER_EXTRA_PCT}%"),
    ):
        tr = solve(build, "restart_cost_s", 5.0, 7200.0, target, which, seeds, gpu_hours)
        fe = solve(build, "fault_every_min", 0.5, 2000.0, target, which, seeds, gpu_hours)
        lines.append(
            f"for {what}: restart cost {tr} s (losses every {fmt(every_min, 1)} min), "
            f"or a loss every {fe} min (restart {fmt(restart_s, 0)} s)"
        )
    return lines
