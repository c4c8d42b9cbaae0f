"""Compare a run with faults against its failure-free reference: the product's promise, measured.

Invariant: the comparison is over the same steps of the same config; `max_rel_loss_diff` is the
largest |loss - ref| / |ref| over every step both runs committed, never a subset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

from recover.app import rundir

matplotlib.use("Agg")  # headless: the plot is a file
import matplotlib.pyplot as plt  # noqa: E402


def max_rel_loss_diff(run: list[dict[str, Any]], ref: list[dict[str, Any]]) -> float:
    ref_by_step = {r["step"]: r["loss"] for r in ref}
    common = [(r["loss"], ref_by_step[r["step"]]) for r in run if r["step"] in ref_by_step]
    if not common:
        raise ValueError("the run and its reference have no step in common")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in common)


def compare_final_params(run_dir: Path, ref_dir: Path) -> tuple[bool, float]:
    """(bitwise equal, relative L2 distance) of every final parameter file of a run against the
    reference's lowest replica with the same rank (`final/replica{r}[.rank{k}].pt`)."""
    import torch

    ref_files: dict[str, Path] = {}
    for f in sorted((ref_dir / rundir.FINAL).glob(rundir.FINAL_GLOB)):
        ref_files.setdefault(_rank_of(f), f)
    run_files = sorted((run_dir / rundir.FINAL).glob(rundir.FINAL_GLOB))
    if not run_files or not ref_files:
        raise ValueError(f"no final parameters to compare in {run_dir} and {ref_dir}")
    equal, num, den = True, 0.0, 0.0
    for f in run_files:
        a = torch.load(f, weights_only=True)
        b = torch.load(ref_files[_rank_of(f)], weights_only=True)
        equal &= a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        num += sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
        den += sum(float(b[k].double().pow(2).sum()) for k in b)
    return equal, (num / max(den, 1e-300)) ** 0.5


def _rank_of(path: Path) -> str:
    parts = path.stem.split(".")
    return parts[1] if len(parts) > 1 else "rank0"


def plot_trajectory(run: list[dict[str, Any]], ref: list[dict[str, Any]], path: Path) -> None:
    """Both loss curves, the fault moments, and the per-step relative difference."""
    ref_by_step = {r["step"]: r["loss"] for r in ref}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([r["step"] for r in ref], [r["loss"] for r in ref], label="failure-free reference",
            lw=3, alpha=0.5)
    ax.plot([r["step"] for r in run], [r["loss"] for r in run], label="with faults", lw=1.2)
    prev_live = None
    for r in run:
        if prev_live is not None and r["live_replicas"] < prev_live or r.get("recovered"):
            for a in (ax, ax2):
                a.axvline(r["step"], color="red", ls=":", lw=1)
        prev_live = r["live_replicas"]
    ax.set_ylabel("training loss")
    ax.legend()
    ax.set_title("loss trajectory: faults vs failure-free (red: replica lost / recovered)")
    steps = [r["step"] for r in run if r["step"] in ref_by_step]
    rel = [abs(r["loss"] - ref_by_step[r["step"]]) / max(abs(ref_by_step[r["step"]]), 1e-12)
           for r in run if r["step"] in ref_by_step]
    ax2.semilogy(steps, [max(x, 1e-12) for x in rel], marker=".")
    ax2.axhline(1e-5, color="gray", ls="--", lw=1)
    ax2.set_ylabel("rel. diff")
    ax2.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
