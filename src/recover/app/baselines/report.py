"""bench.md (the table) and bench.png (committed steps over wall time, with the fault moments).

Invariant: everything written here is read from the measured runs and the calibration; nothing is
recomputed differently for the report, and every figure names its unit.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from recover.app.baselines.runs import SystemRun  # noqa: E402

COLORS = {"recover": "tab:green", "ckpt-restart": "tab:red", "shrink-batch": "tab:orange",
          "reference": "tab:gray"}


def _f(x: float, fmt: str) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def write_md(path: Path, rows: list[dict[str, Any]], info: dict[str, Any],
             validation: list[tuple[str, float, float, float]],
             pooled: list[tuple[str, float, float, float]]) -> None:
    lines = [
        "# recover bench", "",
        f"Command: `{info['command']}`", "",
        f"Setup: R={info['replicas']} replicas, N={info['microbatches']} microbatches x "
        f"{info['microbatch_size']} x {info['block_size']} tokens, {info['steps']} steps, "
        f"preset {info['preset']}, seed {info['seed']}, {info['cores']} CPU cores (1-minute "
        f"load average {info['load'][0]:.1f} at the start, {info['load'][1]:.1f} at the end).", "",
        f"Fault schedule (same for every system): {info['schedule']}.", "",
        f"ckpt-restart: checkpoint every K={info['ckpt_every']} steps (Young-Daly: checkpoint "
        f"cost {info['ckpt_cost_pre_s']:.3f} s measured before the runs, MTBF "
        f"{info['mtbf_s']:.2f} s = {info['steps']} steps x {info['step_time_s']:.3f} s / "
        f"{info['kills']} faults); in-run checkpoint cost {info['ckpt_cost_s']:.3f} s.", "",
        f"Budget for tokens: {info['budget_s']:.1f} s (the failure-free reference's wall time); "
        f"time to step S={info['target_step']}.", "",
        "| system | wall s | startup s | steps | min batch | eff. throughput mb/s "
        "| (incl. startup) | lost mb | tokens in budget | time to S s | final loss | max rel. dev. "
        "| launches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['wall_s']:.1f} | {r['startup_s']:.1f} | {r['steps']} | "
            f"{r['min_batch']} | {r['effective_throughput']:.2f} | "
            f"{r['effective_throughput_incl_startup']:.2f} | {r['lost_microbatches']} | "
            f"{r['tokens_in_budget']:,} | {_f(r['time_to_step_s'], '.1f')} | "
            f"{r['final_loss']:.4f} | {r['max_rel_dev']:.2e} | {r['launches']} |")
    lines += ["", "Wall time: the job's first step starts -> its last step commits; it "
              "includes every cost of a fault (ckpt-restart: teardown, process start, imports, "
              "rendezvous, checkpoint load, redone steps). Startup: the one-off launch before the "
              "first step, paid once by every system whatever its fault policy (and, on a shared "
              "machine, dominated by the load of the moment); the ratio including it is given too. "
              "Effective throughput: microbatches of the final trajectory's committed steps per "
              "second of wall time. ckpt-restart's rolled-back work (\"lost mb\") does not count; "
              "shrink-batch counts the microbatches it processed (\"min batch\" < N after a loss), "
              "with its deviation from the failure-free trajectory next to it. Tokens in budget "
              "and time to S are counted from the first step, on the final trajectory.", ""]
    lines += ["ckpt-restart restarts (a restart costs teardown, process start, imports, "
              "rendezvous, checkpoint load, then the redone steps):", ""]
    lines += [f"- restart {x}" for x in info["restart_lines"]]
    lines += ["", f"**effective_throughput_ratio (recover / ckpt-restart) = "
              f"{info['ratio']:.3f}** (including the one-off startup: "
              f"{info['ratio_incl_startup']:.3f})", "", "## Simulator validation", "",
              "`recover.app.sim.calibrate.predict_wall_times(bench.json)`, fed with the per-step "
              "and per-event costs measured in these runs (never with their wall times). "
              "\"own step times\": each system simulated with the step times of its own run "
              "(bench.json `per_system`), which the simulator needs because this machine's load "
              "changes between runs; \"one set\": every system with the same pooled step "
              "times.", "",
              "| system | predicted s (own step times) | error | predicted s (one set) | error "
              "| measured s |", "|---|---|---|---|---|---|"]
    for (name, pred, meas, err), (_, pred1, _, err1) in zip(validation, pooled, strict=True):
        lines.append(f"| {name} | {pred:.1f} | {100 * err:.1f}% | {pred1:.1f} | "
                     f"{100 * err1:.1f}% | {meas:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, runs: list[SystemRun]) -> None:
    """Left: every system over its whole run; right: zoom on the fastest ones' span."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    zoom = 1.1 * sorted(r.wall_s for r in runs)[-2]  # all but the slowest system
    for ax in axes:
        for run in runs:
            pts = run.progress()
            c = COLORS.get(run.name)
            ax.step([t for t, _ in pts], [s for _, s in pts], where="post", label=run.name,
                    color=c, lw=2 if run.name != "reference" else 1, alpha=0.9)
            for i, t in enumerate(run.loss_times()):
                ax.axvline(t, color=c, ls=":", lw=1,
                           label=f"{run.name}: replica lost" if not i else None)
        ax.set_xlabel("wall time since the first step (s); the one-off startup is left of 0")
        ax.set_ylabel("committed steps")
    axes[0].set_title("progress under the same fault schedule (dotted: replica lost)")
    axes[1].set_xlim(0, zoom)
    axes[1].set_title(f"zoom: the first {zoom:.1f} s")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
