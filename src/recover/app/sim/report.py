"""Text and plot output of `recover simulate`: assumptions, the per-policy table, the curve.

Invariant: everything printed is computed from the `SimParams`, the `FaultSchedule` and the
`PolicyResult`s passed in; no figure is typed in here. Lines are plain text (no colour codes) so the
output can be parsed and diffed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from recover.app.sim.faults import FaultSchedule
from recover.app.sim.params import SimParams, young_daly_steps
from recover.app.sim.results import PolicyResult
from recover.errors import ConfigError


def fmt(x: float, nd: int = 2) -> str:
    """A number for the report (`inf`/`nan` spelled out)."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return f"{x:,.{nd}f}"


def assumptions(p: SimParams, sched: FaultSchedule) -> list[str]:
    """Every parameter the simulation used, one per line, with its meaning."""
    r = p.replicas
    rd = p.detect_s if p.restart_detect_s is None else p.restart_detect_s
    ck = p.ckpt_interval_steps
    if ck is None:
        mtbf = sched.mtbf_s(p.gpus)
        k = young_daly_steps(p.ckpt_cost_s, mtbf, p.step_time_s)
        ck_txt = (
            f"Young-Daly K*step = sqrt(2*C*MTBF), MTBF {fmt(mtbf / 60, 1)} min "
            f"-> K = {k:,} steps at the start (recomputed after each restart)"
            if math.isfinite(mtbf)
            else "none (no faults expected)"
        )
    else:
        ck_txt = f"every {ck} steps (given)"
    end = [
        f"{p.total_steps:,} committed steps" if p.total_steps is not None else None,
        f"{fmt(p.budget_h or 0.0, 2)} h wall-clock budget" if p.budget_h is not None else None,
    ]
    return [
        f"cluster: {p.gpus} GPUs, {p.gpus_per_replica} GPUs per replica -> {r} replicas; "
        f"spares: {p.spares} replica(s), joining {fmt(p.replace_delay_s, 0)} s after a loss "
        "(recover, shrink-batch) or at the restart (ckpt-restart)",
        f"failures: {sched.source}; a failed GPU takes its whole replica (its GPUs are released)",
        f"step: {fmt(p.step_time_s, 3)} s with {r} replicas = {-(-p.n_microbatches // r)} "
        f"microbatch(es) x {fmt(p.mb_time_s, 4)} s + {fmt(p.allreduce_s, 3)} s all-reduce; "
        "with r replicas the busiest does ceil(N/r)"
        + (
            f"; measured step times by replicas {p.step_time_by_replicas}"
            if p.step_time_by_replicas
            else ""
        ),
        f"batch: N = {p.n_microbatches:,} microbatches x {p.tokens_per_microbatch:,} tokens = "
        f"{p.n_microbatches * p.tokens_per_microbatch:,} tokens per step"
        + (
            f" (weak scaling: max(256, {p.microbatches_per_replica} per replica x {r}))"
            if p.microbatches is None
            else " (given)"
        ),
        f"end: {' or '.join(x for x in end if x)}; job stops below {p.min_replicas} replica(s)",
        f"detection: {fmt(p.detect_s, 3)} s (recover, shrink-batch), {fmt(rd, 3)} s "
        f"(ckpt-restart); startup: {fmt(p.startup_s, 1)} s once",
        f"recover: rebuild {fmt(p.rebuild_s, 3)} s + recompute of the lost quota on the survivors; "
        "batch stays N; no checkpoints"
        + (
            f"; control plane {fmt(p.control_plane_s, 4)} s per step (also shrink-batch)"
            if p.control_plane_s
            else ""
        ),
        f"ckpt-restart: checkpoint cost {fmt(p.ckpt_cost_s, 1)} s, interval {ck_txt}; restart "
        f"{fmt(p.restart_cost_s, 1)} s (teardown, launch, rendezvous, load) + redo since the "
        "last checkpoint; resumes on the survivors",
        f"shrink-batch: faulted step discarded, rebuild {fmt(p.rebuild_s, 3)} s; survivors keep "
        "their quota, so the global batch shrinks (trajectory NOT preserved)",
        "GPU-hours: every healthy allocated GPU (active, restarting, spare) is charged until the "
        "job ends",
    ]


def human(x: float) -> str:
    """A count or size in short form: 912, 12.3k, 4.56M, 7.89B."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}" if abs(x) < 100 * div else f"{x / div:,.0f}{suffix}"
    return f"{x:.3g}"


def duration(s: float) -> str:
    """Seconds as `12.3 s`, `45.6 min` or `7.89 h`."""
    if s < 600:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.2f} h"


def table(results: dict[str, PolicyResult]) -> list[str]:
    """One row per policy: wall time, progress, waste, GPU-hours, effective throughput, events."""
    head = (
        f"{'policy':<13}{'wall':>10}{'steps':>9}{'tokens':>9}{'lost':>8}"
        f"{'GPU-h':>9}{'tok/s':>9}{'losses':>7}{'restarts':>9}{'ckpts':>7}"
        f"{'discard':>8}{'batch %N':>9}{'min mb':>7}"
    )
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        tok = r.tokens_per_microbatch
        lines.append(
            f"{name:<13}{duration(r.wall_s):>10}{r.steps:>9,}{human(r.committed_mb * tok):>9}"
            f"{human(r.lost_mb * tok):>8}{human(r.gpu_hours):>9}"
            f"{human(r.throughput_mb_s * tok):>9}{r.replica_losses:>7}{r.restarts:>9}"
            f"{r.checkpoints:>7}{r.discarded_steps:>8}{100 * r.mean_batch_frac:>9.1f}"
            f"{r.min_batch_mb:>7}"
        )
    lines.append(
        "(tokens: committed on the trajectory; lost: computed then rolled back or discarded; "
        "tok/s: effective throughput)"
    )
    for name, r in results.items():
        if not r.finished and r.stop_reason not in ("budget", ""):
            lines.append(f"note: {name} stopped: {r.stop_reason}")
    return lines


def plot(
    results: dict[str, PolicyResult],
    path: str,
    mark_gpu_hours: float | None = None,
    title: str = "",
) -> str:
    """Committed tokens vs GPU-hours per policy, fault moments marked; write PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        xs = [row[1] for row in r.series]
        ys = [row[2] / 1e9 for row in r.series]
        ax.plot(xs, ys, label=f"{name} ({fmt(r.committed_tokens / 1e9, 2)} B tokens)")
    first = next(iter(results.values()), None)
    if first is not None:
        for i, t in enumerate(first.fault_times_s):
            ax.axvline(
                first.gpu_hours_at(t),
                color="red",
                alpha=0.25,
                lw=0.8,
                label="replica lost" if i == 0 else None,
            )
    if mark_gpu_hours is not None:
        ax.axvline(mark_gpu_hours, color="black", ls="--", lw=1, label=f"{mark_gpu_hours:g} GPU-h")
    ax.set_xlabel("GPU-hours consumed")
    ax.set_ylabel("committed tokens (billions)")
    ax.set_title(
        title
        or "committed tokens vs GPU-hours (shrink-batch: smaller batches, "
        "trajectory not preserved)",
        fontsize=10,
    )
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(fig, ax, path)


def save_figure(fig, ax, path: str | Path) -> str:  # type: ignore[no-untyped-def]
    """Grid, write (making the folder), close; return the path written."""
    ax.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(out)


def results_json(results: dict[str, PolicyResult]) -> dict[str, dict[str, object]]:
    """A JSON-able summary (the series thinned to at most ~2,000 points per policy)."""
    out: dict[str, dict[str, object]] = {}
    for name, r in results.items():
        step = max(1, len(r.series) // 2000)
        out[name] = {
            "wall_s": r.wall_s,
            "steps": r.steps,
            "committed_microbatches": r.committed_mb,
            "processed_microbatches": r.processed_mb,
            "committed_tokens": r.committed_tokens,
            "gpu_hours": r.gpu_hours,
            "effective_tokens_per_s": r.throughput_mb_s * r.tokens_per_microbatch,
            "replica_losses": r.replica_losses,
            "restarts": r.restarts,
            "checkpoints": r.checkpoints,
            "discarded_steps": r.discarded_steps,
            "mean_batch_frac": r.mean_batch_frac,
            "min_batch_microbatches": r.min_batch_mb,
            "finished": r.finished,
            "stop_reason": r.stop_reason,
            "fault_times_s": r.fault_times_s,
            "series_wall_s_gpu_h_committed_processed_tokens": r.series[::step] + r.series[-1:],
        }
    return out


def write_outputs(
    results: dict[str, PolicyResult],
    png: str | None,
    out_dir: str | None,
    gpu_hours: float,
    ratio: float,
    extra: float,
    p: SimParams,
) -> list[str]:
    """Write the plot and/or `out_dir/results.json`; return the lines saying where."""
    lines = []
    try:
        if png:
            lines.append(f"plot: {plot(results, png, gpu_hours)}")
        if out_dir:
            path = Path(out_dir) / "results.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = {
                "params": asdict(p),
                "throughput_ratio": ratio,
                "extra_tokens_pct_at_234_gpu_hours": extra,
                "policies": results_json(results),
            }
            path.write_text(json.dumps(doc, indent=1, default=str, allow_nan=True))
            lines.append(f"results: {path}")
    except (OSError, ValueError) as e:  # unwritable path, unknown image format
        raise ConfigError(f"cannot write output: {e}") from None
    return lines


def throughput_lines(results: dict[str, PolicyResult]) -> list[str]:
    """Effective throughput of recover and ckpt-restart, whole run and after the first loss."""
    from recover.app.sim.results import throughput_ratio, window_throughput

    rec, ck = results.get("recover"), results.get("ckpt-restart")
    if rec is None or ck is None:
        return []
    whole = rec.throughput_mb_s / ck.throughput_mb_s if ck.throughput_mb_s > 0 else math.inf
    ta = rec.throughput_mb_s * rec.tokens_per_microbatch
    tb = ck.throughput_mb_s * ck.tokens_per_microbatch
    lines = [
        f"effective throughput, whole run: recover {fmt(ta, 0)} tok/s, ckpt-restart "
        f"{fmt(tb, 0)} tok/s (ratio {fmt(whole)})"
    ]
    firsts = rec.fault_times_s[:1] + ck.fault_times_s[:1]
    if firsts:
        t0, t1 = min(firsts), min(rec.wall_s, ck.wall_s)
        a, b = window_throughput(rec, t0, t1), window_throughput(ck, t0, t1)
        lines.append(
            f"effective throughput from the first loss ({duration(t0)}) to "
            f"{duration(t1)}: recover {fmt(a, 0)} tok/s, ckpt-restart {fmt(b, 0)} tok/s "
            f"(ratio {fmt(throughput_ratio(rec, ck))})"
        )
    return lines
