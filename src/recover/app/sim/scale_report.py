"""`recover simulate --scenario scale`: its options, its printed assumptions, table and plot.

Invariant: every number printed is computed from the `ScaleSpec`, the `SimParams` and the rows of
`scale.sweep`; every assumption is printed before the table; the run ends with the line
`ettr_recover_at_100k=<x>` (after `ettr_ckpt_restart_at_100k=` and `ettr_shrink_batch_at_100k=`).
User mistakes raise `ConfigError` (one line, exit status 2, in `cli.run_cli`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from recover.app.sim.curve import COLUMNS, load_curve, x_of
from recover.app.sim.params import SimParams, young_daly_steps
from recover.app.sim.report import fmt, save_figure
from recover.app.sim.scale import (
    FTHSDP_AT_100K,
    MAIN_FAILURE_COLUMNS,
    QUICK_HORIZON_H,
    QUICK_SIZES,
    REBUILD_COLUMN,
    RESTART_ANCHORS,
    SPARE_FACTOR,
    TARGET_GPUS,
    ScaleSpec,
    SizeRow,
    at_target,
    control_mode,
    control_plane_s,
    recover_pause_s,
    recovery_store_s,
    rendezvous_groups,
    rendezvous_store_s,
    restart_fit,
    run_size,
    scale_base,
    shards_for,
    store_serial_s,
    sweep,
    target_weights,
)
from recover.errors import ConfigError

#: SimParams fields the scenario sets per size itself (giving one is an error).
SCALE_OWNS = ("gpus", "failure_trace", "fault_times_h", "fault_steps", "total_steps")
PAPER_ONLY = ("fault_every_min", "fault_schedule", "lost_gpus", "sensitivity", "calibrate")
DEFAULT_PLOT = "runs/simulate-scale/ettr_vs_gpus.png"
GOAL = 0.95


def run_scale_cli(a: dict[str, Any], flags: dict[str, Any]) -> int:
    """The scale scenario from parsed options `a` (SimParams flags in `flags`)."""
    for key in (*SCALE_OWNS, *PAPER_ONLY):
        if a.get(key, False) is not False:  # store_true options are always present
            raise ConfigError(f"--scenario scale sets this itself; drop --{key.replace('_', '-')}")
    quick = bool(a.get("quick"))
    base = scale_base()
    if quick:
        base = replace(base, budget_h=QUICK_HORIZON_H)
    base = replace(base, **flags)
    spec = ScaleSpec(
        sizes=tuple(a.get("sizes") or (QUICK_SIZES if quick else ScaleSpec.sizes)),
        seeds=int(a.get("seeds", 1 if quick else ScaleSpec.seeds)),
        curve=load_curve(a.get("curve")),
        fit_mode=a.get("curve_fit", "mixed"),
        given=set(flags),
        rebuild=a.get("rebuild", "cpu"),
        control=a.get("control", "cpu"),
    )
    if not 1 <= spec.seeds <= 1000:
        raise ConfigError("seeds must be within 1..1000")
    for g in spec.sizes:
        if g < 1 or g % base.gpus_per_replica:
            raise ConfigError(
                f"size {g} is not a whole number of {base.gpus_per_replica}-GPU replicas"
            )
    if base.budget_h is None:
        raise ConfigError("--scenario scale needs a horizon: give --budget-h hours (default 168)")
    replace(base, gpus=spec.sizes[0] if spec.sizes else base.gpus).validate()
    rows = sweep(base, spec)
    for line in assumption_lines(base, spec):
        print(line)
    print()
    for line in table_lines(rows):
        print(line)
    print()
    for line in summary_lines(base, spec, rows):
        print(line)
    out = Path(a["out"]) if "out" in a else None
    png = a.get("plot") or (str(out / "ettr_vs_gpus.png") if out else DEFAULT_PLOT)
    try:
        print(f"plot: {plot_ettr(rows, png, spec)}")
        if out is not None:
            print(f"results: {write_json(rows, spec, out / 'results.json')}")
    except (OSError, ValueError) as e:  # unwritable path, unknown image format
        raise ConfigError(f"cannot write output: {e}") from None
    for name, key in (("ckpt-restart", "ckpt_restart"), ("shrink-batch", "shrink_batch")):
        print(f"ettr_{key}_at_100k={at_target(rows, name):.4f}")
    print(f"ettr_recover_at_100k={at_target(rows, 'recover'):.4f}")
    return 0


def assumption_lines(base: SimParams, spec: ScaleSpec) -> list[str]:
    """Every assumption of the sweep, one per line (sources in `recover.app.sim.scale`)."""
    assert spec.curve is not None
    fits, rf = spec.fits(), restart_fit()
    (g0, s0, src0), (g1, s1, src1) = RESTART_ANCHORS
    seeds = f"seeds 0..{spec.seeds - 1} pooled" if spec.seeds > 1 else "seed 0"
    mttf = base.per_gpu_mttf_h
    lines = [
        "recover simulate: scenario scale: effective training time ratio (ETTR) of recover, "
        "ckpt-restart and shrink-batch by job size",
        "assumptions:",
        f"  sizes: {', '.join(f'{g:,}' for g in spec.sizes)} GPUs; horizon "
        f"{fmt(base.budget_h, 1)} h of wall clock per size; {seeds} (tokens summed first)",
        "  failures: "
        + (
            f"exponential per-GPU lifetimes, MTTF {fmt(mttf, 0)} h (Llama 3, Dubey et al. 2024, "
            "section 3.3.4: 419 unexpected interruptions in 54 days on 16,384 GPUs); a failed "
            "GPU takes its whole replica"
            if mttf is not None
            else "none (--per-gpu-mttf-h none)"
        ),
        f"  replicas: {base.gpus_per_replica} GPUs each (Llama 3 405B: TP 8 x PP 16); weak "
        f"scaling N = {base.microbatches_per_replica} microbatches per replica (Llama 3 405B: "
        "16M-token batch = 2,048 sequences over 128 replicas) x "
        f"{base.tokens_per_microbatch:,} tokens",
        f"  step: {fmt(base.step_time_s, 3)} s with every replica ({fmt(base.allreduce_s, 3)} s "
        "of it the cross-replica all-reduce); with r replicas the busiest computes ceil(N/r)",
        f"  replacements: a lost replica's place is refilled {fmt(base.replace_delay_s, 0)} s "
        "after the loss (recover, shrink-batch) or at the restart (ckpt-restart), from a pool "
        f"of {fmt(SPARE_FACTOR, 0)}x the expected losses (its GPUs fail too)",
        f"  ckpt-restart: stall per failure restart(G) = {rf.describe().replace('ranks', 'G')} s "
        f"(detection included), through {s0:.0f} s at {g0:,} GPUs ({src0}) and {s1:.0f} s at "
        f"{g1:,} GPUs ({src1}); checkpoint {fmt(base.ckpt_cost_s, 0)} s at any size, "
        "Young-Daly interval; work since the last checkpoint rolled back",
    ]
    return lines + recover_lines(base, spec, fits)


def recover_lines(base: SimParams, spec: ScaleSpec, fits: dict) -> list[str]:
    """How recover's pauses and control plane are charged, from the measured scale curve."""
    assert spec.curve is not None
    given = sorted(spec.given)
    lines = [
        f"  recover: scale curve {spec.curve.path}",
        f"    source: {spec.curve.source}",
        f"    measured at ranks {spec.curve.ranks}, rebuilt groups of "
        f"{spec.curve.group or spec.curve.ranks} members; fits ({spec.fit_mode}): "
        + "; ".join(
            f"{c} = {fits[c].describe().replace('ranks', 'G' if x_of(c) == 'ranks' else 'R')}"
            for c in (*COLUMNS, "control_plane_cpu_s") if c in fits
        ),
        "    sizes: G = the job's ranks (one per GPU: detect, agree, control plane, store ops); "
        f"R = the members of one rebuilt cross-replica group = GPUs / {base.gpus_per_replica} "
        "(one per replica; one group per position, all built in parallel)",
        "    per failure: detect(G), then agree(G) + rebuild(R), then the lost replica's quota "
        "recomputed on the survivors, then the redone reduce = one more cross-replica all-reduce "
        f"of the gradient ({fmt(base.allreduce_s, 3)} s, as every step's; the curve's reduce_s "
        "is of 1k floats on loopback and is not used); the control plane(G) after every step",
        (
            "    rebuild per member: rebuild_cpu_s, the rank's own CPU time over its rebuild "
            "(ASSUMPTION: contention-free, each rank on its own cores; the measuring machine "
            "ran every rank on 2 cores, so their wall time mostly waited for a core; the "
            "rendezvous' network latency and the store server's load are not in it); the "
            "measured wall clock is the sensitivity line below"
            if spec.rebuild == "cpu"
            else "    rebuild per member: rebuild_s, the measured wall clock (every rank of the "
            "measurement shared 2 cores: includes CPU contention)"
        ),
    ]
    lines.append(control_line(spec, fits))
    lines.append(recovery_store_line(spec, fits))
    lines.append(rendezvous_line(base, spec, fits))
    store = spec.curve.values.get("store_cpu_s")
    if store:
        lines.append(
            "    measured beside them (a cross-check, not charged again): the coordinator's CPU "
            f"per recovery (its store and shard servers), {', '.join(fmt(v, 3) for v in store)} "
            f"s for groups of {spec.curve.group or spec.curve.ranks}"
        )
    lines += [
        "  shrink-batch: recover's detection, agreement, rebuild and control plane; the faulted "
        "step is discarded and the batch shrinks until the replacement joins",
        "  ETTR = committed tokens / (failure-free tokens per second x horizon); failure-free: "
        "every replica, no checkpoints, no control plane; shrink-batch's smaller batches count "
        "by their tokens (its trajectory is not corrected for)",
        f"  at {TARGET_GPUS:,} GPUs: {target_weights(list(spec.sizes))[1]}",
    ]
    if given:
        lines.append("  given (not modelled): " + ", ".join(given))
    return lines


def recovery_store_line(spec: ScaleSpec, fits: dict) -> str:
    """How a failure's requests of the main store are charged (`recovery_store_s`)."""
    g = TARGET_GPUS
    column = next((c for c in MAIN_FAILURE_COLUMNS if c in fits), None)
    if column is None or control_mode(spec) == "wall":
        return ("    per failure, the main store's work for the recovery's requests: not charged "
                "(the curve measures neither failure_main_requests_per_rank nor "
                "recovery_store_ops_per_rank, or the control plane is charged as the wall clock)")
    shards = spec.curve.store_shards if spec.curve else None
    split = spec.speaker and column == MAIN_FAILURE_COLUMNS[0]
    who = ("each replica's speaker all of it (a multi-rank replica's other ranks nothing)"
           if split else "each of a replica's ranks all of it")
    what = ("every request the failure makes of it (measured with "
            f"{'?' if shards is None else shards} store shards; one rank per replica there; "
            f"here {who}; plus the coordinator's per failure)"
            if column == MAIN_FAILURE_COLUMNS[0] else "the round trips the failure adds to the "
            "engine's step (an older curve: generation reads, deletions and the coordinator's "
            "not in it)")
    return (f"    per failure, + the main store's serial work for {what}: {column}(G) "
            f"({fmt(fits[column](g), 2)} at {g:,}) x the measured CPU per request = "
            f"{fmt(recovery_store_s(spec, fits, g), 2)} s at {g:,} GPUs (in series on its one "
            "thread)")


def rendezvous_line(base: SimParams, spec: ScaleSpec, fits: dict) -> str:
    """How the rebuild's rendezvous is charged (`rendezvous_store_s`)."""
    g = TARGET_GPUS
    r = g // base.gpus_per_replica
    column = "failure_shard_requests_per_member"
    if column not in fits or control_mode(spec) == "wall":
        return ("    per failure, the store's work for the rebuild's rendezvous: not charged (the "
                f"curve does not measure {column}, or the control plane is charged as the wall "
                "clock)")
    groups = rendezvous_groups(spec, g, r)
    where = (f"{shards_for(g)} shards, position p's group on shard p mod S: {groups} group(s) "
             "on the busiest" if control_mode(spec) == "cpu" and shards_for(g) > 1
             else "one store: every position's group")
    nbytes = "failure_shard_bytes_per_member"
    sent = (f" + {nbytes}(R) ({fmt(fits[nbytes](r) / 1e6, 2)} MB per member) x the CPU per "
            f"byte ({fmt((spec.curve.byte_cpu_s or 0.0) * 1e9, 2)} ns)" if nbytes in fits
            else " (the bytes of its O(R)-sized values are not measured in this curve)")
    return (f"    per failure, + the rendezvous of the rebuilt groups (barrier, addresses, gloo's "
            f"full-mesh exchange, its reads batched) on the busiest store server: R x the groups "
            f"there ({where}) x ({column}(R) ({fmt(fits[column](r), 1)} per member at R = "
            f"{r:,}) x the CPU per request{sent}) = "
            f"{fmt(rendezvous_store_s(spec, fits, g, r), 2)} s at {g:,} GPUs (ASSUMPTION: "
            "gloo's rendezvous, pairs named by rank; a backend that exchanges O(1) per member "
            "is the log2 sensitivity line)")


def control_line(spec: ScaleSpec, fits: dict) -> str:
    """How the failure-free control plane per step is charged (`ScaleSpec.control`)."""
    mode, g = control_mode(spec), TARGET_GPUS
    if mode == "wall":
        return ("    control plane per step: control_plane_s, the measured wall clock (every "
                "rank on 2 shared cores: mostly the wait for a core)"
                + ("" if spec.control == "wall" else "; the curve has no control_plane_cpu_s "
                   "or store_request_cpu_s for the contention-free model"))
    per = float(spec.curve.request_cpu_s or 0.0)  # type: ignore[union-attr]
    who = "replicas' speakers'" if spec.speaker else "ranks'"
    how = (f"{shards_for(g)} store shards at {g:,} ranks (`--store-shards` = G / 1,024, "
           "control/shards.py; ASSUMPTION: the coordinator's host gives each shard "
           f"server its own core): a shard's {who} requests in series (a multi-rank "
           "replica's rank 0 speaks for it, recovery/decide.py), then the "
           "coordinator's decision on the main store and its copy into every shard"
           if mode == "cpu" else f"one store server: every one of the {who} requests in "
           "series")
    return (f"    control plane per step: control_plane_cpu_s(G), a rank's own CPU in it "
            "(ASSUMPTION: contention-free, as the rebuild; network round trips not in it), + "
            f"the store servers' serial work at {per * 1e6:.1f} us of CPU per request "
            f"(measured), {how}: {fmt(store_serial_s(spec, fits, g) * 1e3, 1)} ms + "
            f"{fmt(fits['control_plane_cpu_s'](g) * 1e3, 2)} ms at {g:,} GPUs; the wall clock "
            "measured on 2 shared cores is a sensitivity line")


def table_lines(rows: list[SizeRow]) -> list[str]:
    """One row per size: shape, failure rate, per-failure costs, and each policy's ETTR."""
    head = (
        f"{'GPUs':>8}{'replicas':>9}{'N':>8}{'MTBF':>9}{'losses':>8}{'ckpt K':>8}"
        f"{'restart':>9}{'pause':>10}{'ctl ms':>8}{'recover':>9}{'ckpt-rst':>9}{'shrink':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r.params
        mtbf = p.per_gpu_mttf_h * 3600 / p.gpus if p.per_gpu_mttf_h else math.inf
        k = young_daly_steps(p.ckpt_cost_s, mtbf, p.step_time_s)
        lines.append(
            f"{r.gpus:>8,}{p.replicas:>9,}{p.n_microbatches:>8,}"
            f"{(fmt(mtbf / 60, 1) + 'm') if math.isfinite(mtbf) else 'inf':>9}"
            f"{r.losses:>8.1f}{k if math.isfinite(mtbf) else 0:>8,}"
            f"{fmt(p.restart_cost_s, 0) + 's':>9}{fmt(p.detect_s + p.rebuild_s, 1) + 's':>10}"
            f"{1000 * p.control_plane_s:>8.2f}{r.ettr['recover']:>9.4f}"
            f"{r.ettr['ckpt-restart']:>9.4f}{r.ettr['shrink-batch']:>8.4f}"
        )
    lines.append(
        "(MTBF: the job's at the start; losses: replica losses per seed; ckpt K: Young-Daly "
        "steps between checkpoints; restart: ckpt-restart's stall per failure; pause: "
        "recover's detect + agree + rebuild per failure, before its recompute and redone "
        "all-reduce; ctl: its control plane per step)"
    )
    return lines


def summary_lines(base: SimParams, spec: ScaleSpec, rows: list[SizeRow]) -> list[str]:
    """Goal, the published reference, and the costs at 100k that decide recover's figure."""
    fits = spec.fits()
    g = TARGET_GPUS
    r = g // base.gpus_per_replica
    col = REBUILD_COLUMN[spec.rebuild]
    store = recovery_store_s(spec, fits, g)
    rendezvous = rendezvous_store_s(spec, fits, g, r)
    parts = (
        f"detect {fmt(fits['detect_s'](g), 2)}, agree {fmt(fits['agree_s'](g), 2)}, the main "
        f"store's recovery requests {fmt(store, 2)}, the rendezvous' on the busiest store "
        f"server {fmt(rendezvous, 2)}, rebuild of a {r}-member group "
        f"{fmt(fits[col](r), 2)} ({col}), then the recompute and a "
        f"{fmt(base.allreduce_s, 2)} s all-reduce"
    )
    pause = (fits["detect_s"](g) + recover_pause_s(fits, g, r, spec.rebuild) + store
             + rendezvous)
    mtbf = base.per_gpu_mttf_h * 3600 / g if base.per_gpu_mttf_h else math.inf
    ref = ", ".join(f"{k} {v}" for k, v in FTHSDP_AT_100K.items())
    lines = [
        f"at {g:,} GPUs: recover's pause per failure {fmt(pause, 1)} s ({parts}) against a job "
        f"MTBF of {fmt(mtbf / 60, 1)} min; ckpt-restart's stall {fmt(restart_fit()(g), 0)} s "
        "plus the rolled-back work",
        f"published at O(100K) GPUs (FT-HSDP, arXiv 2602.00277): ETTR {ref}; goal for recover: "
        f">= {GOAL}",
    ]
    near = tuple(target_weights(list(spec.sizes))[0]) if spec.sizes else ()
    if spec.rebuild == "cpu" and near:
        alt = replace(spec, rebuild="wall", sizes=near)
        alt_rows = [run_size(base, s, alt) for s in alt.sizes]
        lines.append(
            "sensitivity: with the measured wall-clock rebuild (rebuild_s: every rank on 2 "
            f"shared cores; {fmt(fits['rebuild_s'](r), 1)} s for {r} members) instead of the "
            f"contention-free one, recover's ETTR at 100k would be "
            f"{at_target(alt_rows, 'recover'):.4f}"
        )
    if control_mode(spec) == "cpu" and near:
        for mode, what in (
            ("one-store", "with every rank's requests on one store server (no --store-shards)"),
            ("wall", "with the control plane's wall clock measured on 2 shared cores"),
            ("no-speaker", "with every rank asking the store each step (no speaker per "
                           "replica)"),
        ):
            alt = (replace(spec, speaker=False, sizes=near) if mode == "no-speaker"
                   else replace(spec, control=mode, sizes=near))
            alt_rows = [run_size(base, s, alt) for s in alt.sizes]
            lines.append(
                f"sensitivity: {what} ({fmt(control_plane_s(alt, fits, g), 3)} s a step at "
                f"{g:,} ranks), recover's ETTR at 100k would be "
                f"{at_target(alt_rows, 'recover'):.4f}"
            )
    if spec.fit_mode == "mixed" and near:
        alt = replace(spec, fit_mode="log2", sizes=near)
        alt_rows = [run_size(base, s, alt) for s in alt.sizes]
        lines.append(
            "sensitivity: with every curve column fitted as a + b*log2(size) (a backend that "
            "does not connect a full mesh), recover's ETTR at 100k would be "
            f"{at_target(alt_rows, 'recover'):.4f}"
        )
    return lines


def plot_ettr(rows: list[SizeRow], path: str, spec: ScaleSpec) -> str:
    """ETTR vs GPUs per policy, the goal and FT-HSDP's published points; PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [r.gpus for r in rows]
    # recover wide and first, shrink-batch thin and dashed on top: their lines often coincide.
    for name, style, color, lw in (
        ("recover", "-", "tab:blue", 3.0),
        ("ckpt-restart", "-", "tab:orange", 1.5),
        ("shrink-batch", "--", "tab:green", 1.2),
    ):
        ax.plot(xs, [r.ettr[name] for r in rows], style, color=color, marker="o", lw=lw, label=name)
    for (label, v), m in zip(FTHSDP_AT_100K.items(), ("x", "+"), strict=True):
        ax.plot([TARGET_GPUS], [v], m, color="black", ms=9, label=f"published: {label}")
    ax.axhline(GOAL, color="tab:red", ls=":", lw=1, label=f"goal {GOAL}")
    ax.axvline(TARGET_GPUS, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{g // 1024}k" if g >= 1024 else str(g) for g in xs])
    ax.set_xlabel("GPUs (weak scaling)")
    ax.set_ylabel("ETTR (failure-free time / actual time)")
    src = spec.curve.source if spec.curve else ""
    tag = " (PLACEHOLDER recover curve)" if src.lower().startswith("placeholder") else ""
    ax.set_title(f"effective training time ratio, Llama 3 failure rate{tag}", fontsize=10)
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower left", fontsize=8)
    return save_figure(fig, ax, path)


def write_json(rows: list[SizeRow], spec: ScaleSpec, path: Path) -> str:
    doc = {
        "curve": {"path": spec.curve.path, "source": spec.curve.source} if spec.curve else None,
        "fit_mode": spec.fit_mode,
        "seeds": spec.seeds,
        "sizes": [
            {"gpus": r.gpus, "ettr": r.ettr, "losses": r.losses, "params": asdict(r.params)}
            for r in rows
        ],
        "at_100k": {name: at_target(rows, name) for name in rows[0].ettr} if rows else {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    return str(path)
