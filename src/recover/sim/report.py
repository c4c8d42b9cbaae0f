"""Text and plot output of `recover simulate`: assumptions, the per-policy table, the curve.

Invariant: everything printed is computed from the `SimParams`, the `FaultSchedule` and the
`PolicyResult`s passed in; no figure is typed in here. Lines are plain text (no colour codes) so the
output can be parsed and diffed.
"""

from __future__ import annotations

import math
from pathlib import Path

from recover.sim.faults import FaultSchedule
from recover.sim.params import SimParams, young_daly_steps
from recover.sim.results import PolicyResult


def fmt(x: float, nd: int = 2) -> str:
    """A number for the report (`inf`/`nan` spelled out)."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return f"{x:,.{nd}f}"


def assumptions(p: SimParams, sched: FaultSchedule) -> list[str]:
    """Every parameter the simulation used, one per line, with its meaning."""
    r = p.replicas
    ck = p.ckpt_interval_steps
    if ck is None:
        mtbf = sched.mtbf_s(p.gpus)
        k = young_daly_steps(p.ckpt_cost_s, mtbf, p.step_time_s)
        ck_txt = (f"Young-Daly K*step = sqrt(2*C*MTBF), MTBF {fmt(mtbf / 60, 1)} min "
                  f"-> K = {k:,} steps at the start (recomputed after each restart)"
                  if math.isfinite(mtbf) else "none (no faults expected)")
    else:
        ck_txt = f"every {ck} steps (given)"
    end = [f"{p.total_steps:,} committed steps" if p.total_steps is not None else None,
           f"{fmt(p.budget_h or 0.0, 2)} h wall-clock budget" if p.budget_h is not None else None]
    return [
        f"cluster: {p.gpus} GPUs, {p.gpus_per_replica} GPUs per replica -> {r} replicas; "
        f"spares: {p.spares} replica(s), joining {fmt(p.replace_delay_s, 0)} s after a loss "
        "(recover, shrink-batch) or at the restart (ckpt-restart)",
        f"failures: {sched.source}; a failed GPU takes its whole replica (its GPUs are released)",
        f"step: {fmt(p.step_time_s, 3)} s with {r} replicas = {-(-p.microbatches // r)} microbatches"
        f" x {fmt(p.mb_time_s, 4)} s + {fmt(p.allreduce_s, 3)} s all-reduce (+overhead); "
        "with r replicas the busiest does ceil(N/r)",
        f"batch: N = {p.microbatches} microbatches x {p.tokens_per_microbatch:,} tokens = "
        f"{p.microbatches * p.tokens_per_microbatch:,} tokens per step",
        f"end: {' or '.join(x for x in end if x)}; job stops below {p.min_replicas} replica(s)",
        f"detection: {fmt(p.detect_s, 3)} s (all policies); startup: {fmt(p.startup_s, 1)} s once",
        f"recover: rebuild {fmt(p.rebuild_s, 3)} s + recompute of the lost quota on the survivors; "
        "batch stays N; no checkpoints",
        f"ckpt-restart: checkpoint cost {fmt(p.ckpt_cost_s, 1)} s, interval {ck_txt}; restart "
        f"{fmt(p.restart_cost_s, 1)} s (teardown, launch, rendezvous, load) + redo since the "
        "last checkpoint; resumes on the survivors",
        f"shrink-batch: faulted step discarded, rebuild {fmt(p.rebuild_s, 3)} s; survivors keep "
        "their quota, so the global batch shrinks (trajectory NOT preserved)",
        "GPU-hours: every healthy allocated GPU (active, restarting, spare) is charged until the "
        "job ends",
    ]


def table(results: dict[str, PolicyResult]) -> list[str]:
    """One row per policy: wall time, progress, waste, GPU-hours, effective throughput, events."""
    head = (f"{'policy':<13}{'wall h':>9}{'steps':>10}{'tokens B':>10}{'lost B':>9}"
            f"{'GPU-h':>10}{'tok/s':>12}{'losses':>7}{'restarts':>9}{'ckpts':>7}"
            f"{'discard':>8}{'batch %N':>9}{'min mb':>7}")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        tok = r.tokens_per_microbatch
        lines.append(
            f"{name:<13}{r.wall_s / 3600:>9.3f}{r.steps:>10,}{r.committed_mb * tok / 1e9:>10.3f}"
            f"{r.lost_mb * tok / 1e9:>9.3f}{r.gpu_hours:>10,.1f}"
            f"{r.throughput_mb_s * tok:>12,.0f}{r.replica_losses:>7}{r.restarts:>9}"
            f"{r.checkpoints:>7}{r.discarded_steps:>8}{100 * r.mean_batch_frac:>9.1f}"
            f"{r.min_batch_mb:>7}"
        )
    for name, r in results.items():
        if not r.finished and r.stop_reason not in ("budget", ""):
            lines.append(f"note: {name} stopped: {r.stop_reason}")
    return lines


def plot(results: dict[str, PolicyResult], path: str, mark_gpu_hours: float | None = None,
         title: str = "") -> str:
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
            ax.axvline(first.gpu_hours_at(t), color="red", alpha=0.25, lw=0.8,
                       label="replica lost" if i == 0 else None)
    if mark_gpu_hours is not None:
        ax.axvline(mark_gpu_hours, color="black", ls="--", lw=1, label=f"{mark_gpu_hours:g} GPU-h")
    ax.set_xlabel("GPU-hours consumed")
    ax.set_ylabel("committed tokens (billions)")
    ax.set_title(title or "tokens on the failure-free trajectory vs GPU-hours")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(out)


def results_json(results: dict[str, PolicyResult]) -> dict[str, dict[str, object]]:
    """A JSON-able summary (the series thinned to at most ~2,000 points per policy)."""
    out: dict[str, dict[str, object]] = {}
    for name, r in results.items():
        step = max(1, len(r.series) // 2000)
        out[name] = {
            "wall_s": r.wall_s, "steps": r.steps, "committed_microbatches": r.committed_mb,
            "processed_microbatches": r.processed_mb, "committed_tokens": r.committed_tokens,
            "gpu_hours": r.gpu_hours, "effective_tokens_per_s": r.throughput_mb_s *
            r.tokens_per_microbatch, "replica_losses": r.replica_losses, "restarts": r.restarts,
            "checkpoints": r.checkpoints, "discarded_steps": r.discarded_steps,
            "mean_batch_frac": r.mean_batch_frac, "min_batch_microbatches": r.min_batch_mb,
            "finished": r.finished, "stop_reason": r.stop_reason,
            "fault_times_s": r.fault_times_s,
            "series_wall_s_gpu_h_committed_processed_tokens": r.series[::step] + r.series[-1:],
        }
    return out
