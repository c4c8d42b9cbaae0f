"""Bench figures per system, and the calibration (bench.json) the simulator is validated against.

Invariant: effective throughput counts only microbatches of committed steps that are in the final
trajectory (a ckpt-restart step rolled back and redone counts once; shrink-batch's smaller steps
count what they processed, and their deviation from the reference is reported next to it). The
calibration holds per-step and per-event costs measured in this bench's runs, never a system's
total wall time (that is kept apart, in `wall_s`, only to compare the prediction with).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from recover.app import rundir
from recover.app.baselines.runs import SystemRun
from recover.app.faults import Fault
from recover.app.rundir import read_jsonl
from recover.app.train.reference import max_rel_loss_diff
from recover.control.membership import LEFT_CLEANLY


def summarize(run: SystemRun, ref: SystemRun, budget_s: float, target_step: int) -> dict[str, Any]:
    cfg = run.cfg
    tok_mb = cfg.data.microbatch_size * cfg.model.block_size
    commit = run.commit_abs()
    wall = run.wall_s
    counted = sum(r["microbatches"] for r in run.records)
    in_budget = sum(r["microbatches"] for r in run.records
                    if commit[r["step"]] - run.t0 <= budget_s)
    lost = lost_microbatches(run)
    last = run.records[-1]
    t_s = commit.get(target_step - 1)
    return {
        "system": run.name, "wall_s": wall, "startup_s": run.startup_s,
        "steps": len(run.records),
        "microbatches": counted, "lost_microbatches": lost,
        "min_batch": min(r["microbatches"] for r in run.records),
        "effective_throughput": counted / wall,
        "effective_throughput_incl_startup": counted / (wall + run.startup_s),
        "tokens_in_budget": in_budget * tok_mb,
        "time_to_step_s": (t_s - run.t0) if t_s is not None else math.nan,
        "final_loss": last["loss"], "final_val_loss": last.get("val_loss", math.nan),
        "max_rel_dev": max_rel_loss_diff(run.records, ref.records),
        "launches": len(run.attempts),
    }


def lost_microbatches(run: SystemRun) -> int:
    """Microbatches of steps that were committed and later rolled back (ckpt-restart)."""
    lost = 0
    for prev, cur in zip(run.attempts, run.attempts[1:], strict=False):
        lost += sum(r["microbatches"] for r in prev.result.records if r["step"] >= cur.start_step)
    return lost


def _periods(run: SystemRun, live: int | None = None) -> list[float]:
    """Seconds between consecutive clean commits (same launch, same live count, no recovery),
    and the job's first step (its own duration); a relaunch's first step is its restart's."""
    first = run.attempts[0].result.records[0]
    out = [first["step_time_s"]] if live in (None, first["live_replicas"]) else []
    for a in run.attempts:
        recs = a.result.records
        for p, r in zip(recs, recs[1:], strict=False):
            if r["attempts"] > 1 or r["recovered"] or r["live_replicas"] != p["live_replicas"]:
                continue
            if live is None or r["live_replicas"] == live:
                out.append(r["time_s"] - p["time_s"])
    return out


def _residuals(runs: list[SystemRun]) -> list[float]:
    """Per clean step: commit-to-commit seconds minus the busiest quota x the microbatch time."""
    out = []
    for run in runs:
        for a in run.attempts:
            recs = a.result.records
            for p, r in zip(recs, recs[1:], strict=False):
                if r["attempts"] == 1 and not r["recovered"] and r["live_replicas"] == p[
                        "live_replicas"]:
                    out.append(r["time_s"] - p["time_s"] - max(r["quotas"].values()) * r[
                        "mb_time_s"])
    return out


def _after_ckpt(run: SystemRun, k: int, typical: dict[int, float]) -> list[float]:
    """Extra seconds of the step that follows each checkpoint save (ckpt-restart)."""
    out = []
    for a in run.attempts:
        recs = a.result.records
        for p, r in zip(recs, recs[1:], strict=False):
            if r["step"] % k == 0 and r["attempts"] == 1 and r["live_replicas"] in typical:
                out.append(r["time_s"] - p["time_s"] - typical[r["live_replicas"]])
    return out


def step_period(run: SystemRun) -> float:
    """Mean seconds per clean step (commit to commit) of a run with all its replicas."""
    return statistics.mean(_periods(run, run.cfg.layout.replicas))


_PHASE_OFFSET = {"forward": 0.0, "reduce": 1.0, "commit": 1.0, "optimizer": 1.0}


def calibration(runs: dict[str, SystemRun], ref: SystemRun, faults: list[Fault],
                ckpt_cost_pre_s: float) -> dict[str, Any]:
    """The bench.json of `recover.app.sim.calibrate` from this bench's measurements."""
    cfg = ref.cfg
    n, r0 = cfg.data.microbatches, cfg.layout.replicas
    rec, ckr = runs["recover"], runs["ckpt-restart"]
    # Clean steps with all R replicas, pooled over every run (they all compute N/R each then);
    # with r < R, recover's and ckpt-restart's steps (both spread N over r, as the simulator does).
    step = statistics.mean(p for s in (ref, *runs.values()) for p in _periods(s, r0))
    mb = statistics.mean(x["mb_time_s"] for x in ref.records[1:] or ref.records)
    # What a step costs beyond its busiest replica's compute (reduce, agreement, optimizer, record):
    # the median residual over every clean step of every run.
    allreduce = min(max(0.0, statistics.median(_residuals([ref, *runs.values()]))), 0.9 * step)
    table = {r0: step}
    for r in range(1, r0):
        p = [*_periods(rec, r), *_periods(ckr, r)]
        if p:
            table[r] = max(statistics.mean(p), allreduce * 1.01)
    k = ckr.extra["ckpt_every"]
    in_run = _after_ckpt(ckr, k, table)
    ckpt_cost = statistics.mean(in_run) if in_run else ckpt_cost_pre_s
    restarts = ckr.extra["restarts"]
    restart = [x["first_commit_s"] - table.get(x["replicas"], step) for x in restarts]
    alive, offsets = r0, []
    for f in faults:
        q = math.ceil(n / alive)
        offsets.append(_PHASE_OFFSET.get(f.phase, 0.5 / q))
        alive -= 1
    return {
        "schema": "recover.bench/1", "replicas": r0, "microbatches": n, "steps": cfg.run.steps,
        "step_time_s": step, "microbatch_time_s": mb, "allreduce_s": allreduce,
        "step_time_by_replicas_s": {str(r): t for r, t in sorted(table.items()) if r != r0},
        "ckpt_cost_s": max(0.0, ckpt_cost), "ckpt_cost_premeasured_s": ckpt_cost_pre_s,
        "ckpt_every": k,
        "restart_cost_s": max(0.0, statistics.mean(restart)) if restart else 0.0,
        "restart_detect_s": (max(0.0, statistics.mean(x["detect_s"] for x in restarts))
                             if restarts else 0.0),
        "detect_s": _detect_s(Path(rec.cfg.run.out) / rundir.COORDINATOR_LOG),
        "rebuild_s": _rebuild_s(rec, table, allreduce, n),
        "fault_steps": [f.step for f in faults],
        "fault_offset_frac": statistics.mean(offsets) if offsets else 0.5,
        "startup_s": 0.0,  # wall_s starts at the first step; the one-off launch is apart:
        "startup_measured_s": {s.name: s.startup_s for s in (*runs.values(), ref)},
        "tokens_per_microbatch": cfg.data.microbatch_size * cfg.model.block_size,
        "wall_s": {name: s.wall_s for name, s in runs.items()},
        "per_system": {name: _own_step_times(s, table, allreduce, n) for name, s in runs.items()},
    }


def _own_step_times(run: SystemRun, pooled: dict[int, float], allreduce: float, n: int
                    ) -> dict[str, Any]:
    """A system's step times measured in its own run, in the simulator's terms (N over r).

    The load of a shared machine changes between runs (identical steps can take very different
    times minutes apart), so each system is also simulated with its own step times. shrink-batch's
    steps hold its fixed quota q, not ceil(N / r): its period P is mapped back through the
    simulator's step model, P = t_r + (q - c) * (t_r - allreduce) / c with c = ceil(N / r).
    """
    own, r0 = {}, max(pooled)
    for r in pooled:
        p = _periods(run, r)
        if not p:
            own[r] = pooled[r]
            continue
        c = math.ceil(n / r)
        q = math.ceil(n / r0) if run.cfg.ft.policy == "shrink-batch" else c  # its fixed share
        own[r] = max((c * statistics.mean(p) - allreduce * (c - q)) / q, allreduce * 1.01)
    return {"step_time_s": own[r0],
            "step_time_by_replicas_s": {str(r): t for r, t in sorted(own.items()) if r != r0}}


def _detect_s(log: Path) -> float:
    """recover: first evidence of a loss -> the new generation published (median)."""
    events = read_jsonl(log)
    out, t = [], None
    for e in events:
        if (e["event"] == "evidence" and not e["reason"].startswith(LEFT_CLEANLY)
                and t is None):
            t = e["time"]
        elif e["event"] == "generation" and t is not None:
            out.append(e["time"] - t)
            t = None
    return statistics.median(out) if out else 0.0


def _rebuild_s(rec: SystemRun, table: dict[int, float], allreduce: float, n: int) -> float:
    """recover: the recovered steps' time beyond compute, redo and reduce, i.e. the rebuild."""
    out = []
    for r in rec.records:
        if not r["recovered"]:
            continue
        live = r["live_replicas"]
        t = table.get(live)
        if t is None:
            continue
        redo = math.ceil(len(r["recovered"]) / live) * (t - allreduce) / math.ceil(n / live)
        out.append(r["recovery_s"] - redo - allreduce)
    return max(0.0, statistics.median(out)) if out else 0.0
