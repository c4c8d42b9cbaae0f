"""The scale scenario: effective training time ratio (ETTR) of each policy, 1,024 -> 131,072 GPUs.

Invariant: each size is one `engine.simulate` per seed on one failure sequence shared by the three
policies; between sizes only the GPU count changes, and the costs that follow from it by the models
below. Nothing is typed in: every figure comes from these stated assumptions (all printed by
`recover simulate --scenario scale`), pooled over seeds.

Assumptions:
- Sizes: powers of 2 from 1,024 to 131,072 GPUs (`--sizes` for others; `--quick`: 4 of them).
- Failures: the Llama 3 rate (Dubey et al., 2024, "The Llama 3 Herd of Models", section 3.3.4: 419
  unexpected interruptions in 54 days on 16,384 GPUs), read as independent exponential per-GPU
  lifetimes of mean 50,677 h; a failed GPU takes its whole replica.
- Replicas of 128 GPUs (Llama 3 405B's tensor x pipeline parallel group, TP 8 x PP 16) and weak
  scaling: N = 16 microbatches per replica (Llama 3 405B: a 16M-token batch = 2,048 sequences of
  8,192 tokens over 128 data-parallel replicas at 16,384 GPUs), so each size has the same 5 s step
  (0.5 s of it the cross-replica all-reduce, the simulator's defaults).
- Replacements: a lost replica's place is refilled from a pool of healthy nodes after
  `REPLACE_DELAY_S` (recover and shrink-batch keep training meanwhile; ckpt-restart takes its
  replacement at the restart). The pool holds 3x the expected losses over the horizon (its GPUs
  fail like the others), so it is never exhausted.
- ckpt-restart: restart(G) = a + b*log2(G) seconds per failure (detection included), the line
  through two anchors: 300 s at 512 GPUs (this simulator's default restart, `params.py`) and 600 s
  at 100,000 GPUs (FT-HSDP, arXiv 2602.00277: ~10 minutes of stall per failure for synchronous
  training at O(100K) GPUs). Checkpoints cost 60 s whatever the size (data-parallel replicas hold
  one model: the state to save does not grow), at the Young-Daly interval; work since the last
  checkpoint is rolled back.
- recover: per failure, detect and agree from the measured scale curve (`curve.py`) extrapolated
  to the job's ranks = GPUs (every rank talks to the one coordinator), plus the main store's
  serial work for every request the failure makes of it (`recovery_store_s`: the curve's agree
  was measured where the store served at most 128 ranks), plus the busiest store server's
  serial work for the rebuild's rendezvous (`rendezvous_store_s`: with shards, position p's
  group meets on shard p mod S; gloo's full mesh asks O(R) per member), then the rebuild of
  the cross-replica groups, extrapolated to the size of one group, R = GPUs / 128 (781 at 100,000
  GPUs; one group per position, built in parallel), then the lost quota recomputed on the
  survivors, then the redone reduce: one more cross-replica all-reduce of the gradient, priced
  like every step's (`allreduce_s`, 0.5 s; the curve's loopback reduce of 1k floats is not a
  gradient's). After every step's all-reduce, the control plane (`control_plane_s`): a rank's
  measured CPU in it (`control_plane_cpu_s`, contention-free like the rebuild) + the store
  servers' serial work at the measured CPU per request, with `shards_for(G)` store shards
  (control/shards.py; one core each); `ScaleSpec.control` gives the sensitivity lines.
- The rebuild per group member is contention-free: the curve's `rebuild_cpu_s`, the rebuilding
  rank's own CPU time (every thread) on the measuring machine, where R ranks shared 2 cores so
  its wall time mostly waited for a core. A cluster gives each rank its own cores; the network
  latency of the rendezvous is not in that figure (the store servers' work for it is charged
  apart, `rendezvous_store_s`). The wall-clock fit (`rebuild_s`) is reported as a sensitivity
  line (`--rebuild wall` charges it).
- shrink-batch (torchft): the same detection, agreement, rebuild and control plane as recover (so
  the comparison isolates the batch policy); the faulted step is discarded and the batch shrinks
  until the replacement joins.
- ETTR = committed tokens / (failure-free tokens per second x horizon): failure-free = all
  replicas, no checkpoints, no control plane. Shrink-batch's smaller batches count by their tokens
  (its trajectory is not the failure-free one; no correction is made for that).
- At 100,000 GPUs: linear interpolation in log2(GPUs) between the two sizes around it (the nearest
  size if the sweep does not bracket it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from recover.app.sim.curve import Fit, ScaleCurve
from recover.app.sim.engine import simulate
from recover.app.sim.params import LLAMA3_PER_GPU_MTTF_H, POLICIES, SimParams

SIZES = tuple(2**k for k in range(10, 18))  # 1,024 .. 131,072
QUICK_SIZES = (1024, 8192, 65536, 131072)
TARGET_GPUS = 100_000
GPUS_PER_REPLICA = 128  # Llama 3 405B: TP 8 x PP 16
MICROBATCHES_PER_REPLICA = 16  # Llama 3 405B: 2,048 sequences / 128 replicas
REPLACE_DELAY_S = 600.0
HORIZON_H = 7 * 24.0
QUICK_HORIZON_H = 2 * 24.0
SPARE_FACTOR = 3.0
#: (GPUs, restart seconds) the ckpt-restart model passes through, with where each comes from.
RESTART_ANCHORS = (
    (512, 300.0, "the simulator's default restart, params.py"),
    (100_000, 600.0, "FT-HSDP, arXiv 2602.00277: ~10 min stall per failure at O(100K) GPUs"),
)
FTHSDP_AT_100K = {"synchronous (ckpt-restart)": 0.44, "FT-HSDP": 0.80}


def restart_fit() -> Fit:
    """restart(G) = a + b*log2(G) through the two `RESTART_ANCHORS`."""
    (g0, s0, _), (g1, s1, _) = RESTART_ANCHORS
    b = (s1 - s0) / (math.log2(g1) - math.log2(g0))
    return Fit("log2", s0 - b * math.log2(g0), b)


def scale_base() -> SimParams:
    """The scenario's cluster shape and costs before a size is chosen."""
    return SimParams(
        gpus=GPUS_PER_REPLICA * 8,
        gpus_per_replica=GPUS_PER_REPLICA,
        microbatches_per_replica=MICROBATCHES_PER_REPLICA,
        per_gpu_mttf_h=LLAMA3_PER_GPU_MTTF_H,
        replace_delay_s=REPLACE_DELAY_S,
        restart_detect_s=0.0,  # the restart model's stall includes detection
        total_steps=None,
        budget_h=HORIZON_H,
    )


@dataclass
class ScaleSpec:
    """What to sweep and how: sizes, seeds, the curve and its fits, explicit overrides."""

    sizes: tuple[int, ...] = SIZES
    seeds: int = 3
    curve: ScaleCurve | None = None
    fit_mode: str = "mixed"
    given: set[str] = field(default_factory=set)  # SimParams fields the user set: not modelled
    rebuild: str = "cpu"  # "cpu": the contention-free per-rank rebuild; "wall": as measured
    # The failure-free control plane per step: "cpu" = a rank's own CPU in it (contention-free)
    # + the store servers' serial work with `shards_for(G)` store shards; "one-store" = the
    # same with every request on one server; "wall" = the wall clock on the measuring machine.
    # A curve without control_plane_cpu_s or store_request_cpu_s can only give "wall".
    control: str = "cpu"
    # A multi-rank replica's position 0 alone asks the store for it, a step's count and
    # decision and a failure's chain, redo and evidence (recovery/speaker.py): the store
    # servers serve replicas, not ranks. False: every rank asks (a sensitivity line).
    speaker: bool = True

    def fits(self) -> dict[str, Fit]:
        if self.curve is None:
            raise ValueError("ScaleSpec.curve is not loaded")
        return self.curve.fits(self.fit_mode)


REBUILD_COLUMN = {"cpu": "rebuild_cpu_s", "wall": "rebuild_s"}


def recover_pause_s(fits: dict[str, Fit], gpus: int, group: int, rebuild: str = "cpu") -> float:
    """agree at the job's `gpus` ranks + the rebuild of a `group`-member communicator (charged
    after detection, as `SimParams.rebuild_s`; the redone reduce is the policy's `allreduce_s`)."""
    return fits["agree_s"](gpus) + fits[REBUILD_COLUMN[rebuild]](group)


CONTROL_MODES = ("cpu", "one-store", "wall")
RANKS_PER_SHARD = 1024  # `--store-shards` as the config's help advises: ~1 per 1,000 ranks
MAX_SHARDS = 256  # the most `--store-shards` accepts


def shards_for(gpus: int) -> int:
    """The store shards a job of `gpus` ranks runs with (0: one store below 2,048 ranks)."""
    s = min(MAX_SHARDS, math.ceil(gpus / RANKS_PER_SHARD))
    return s if s > 1 else 0


def control_mode(spec: ScaleSpec) -> str:
    """`spec.control`, or "wall" when the curve lacks what the others need."""
    c = spec.curve
    if c is None or c.request_cpu_s is None or "control_plane_cpu_s" not in c.values:
        return "wall"
    return spec.control


def _replicas(gpus: int) -> int:
    """The replicas of a job of `gpus` GPUs (one speaker each)."""
    return max(1, gpus // GPUS_PER_REPLICA)


def store_serial_s(spec: ScaleSpec, fits: dict[str, Fit], gpus: int) -> float:
    """The store servers' serial work in one failure-free step at `gpus` ranks: each request
    costs the curve's store_request_cpu_s of its server's one thread, and each asker (a
    replica's speaker, `ScaleSpec.speaker`, else every rank) makes the curve's
    store_ops_per_rank_step (measured at one rank per replica: the speaker's own). One store:
    every asker's requests in series. S shards (control/shards.py), each on its own core: a
    shard's askers' requests, then the coordinator's decision on the main store (1) and its copy
    into every shard (S, in series from its one client). 0 in "wall" mode."""
    mode = control_mode(spec)
    if mode == "wall":
        return 0.0
    per = float(spec.curve.request_cpu_s or 0.0)  # type: ignore[union-attr]
    ops = fits["store_ops_per_rank_step"](gpus)
    askers = _replicas(gpus) if spec.speaker else gpus
    shards = shards_for(gpus) if mode == "cpu" else 0
    if shards <= 1:
        return ops * askers * per
    return (ops * math.ceil(askers / shards) + 1 + shards) * per


MAIN_FAILURE_COLUMNS = ("failure_main_requests_per_rank", "recovery_store_ops_per_rank")


def recovery_store_s(spec: ScaleSpec, fits: dict[str, Fit], gpus: int) -> float:
    """The main store's serial work for one failure at `gpus` ranks: every request because of
    it (the failed attempt's decision, the chain's extension, evidence counts, deletions), one
    after another: the curve's failure_main_requests_per_rank (one rank per replica there). With
    a speaker per replica (`ScaleSpec.speaker`) each replica asks it (its speaker: the chain's
    entry, redo, evidence, the decision; recovery/speaker.py); else each of a replica's ranks
    asks it all. Plus the coordinator's failure_coordinator_requests; else (an older curve) the
    engine's own recovery_store_ops_per_rank per rank. 0 in "wall" mode, or when the curve
    measured neither."""
    column = next((c for c in MAIN_FAILURE_COLUMNS if c in fits), None)
    if control_mode(spec) == "wall" or column is None:
        return 0.0
    per = float(spec.curve.request_cpu_s or 0.0)  # type: ignore[union-attr]
    coord = fits.get("failure_coordinator_requests")
    every = fits[column](gpus)
    speakers = spec.speaker and column == MAIN_FAILURE_COLUMNS[0]
    asked = every * (_replicas(gpus) if speakers else gpus)
    return (asked + (coord(gpus) if coord else 0.0)) * per


def rendezvous_groups(spec: ScaleSpec, gpus: int, replicas: int) -> int:
    """How many of the rebuilt groups (one per position) meet on the busiest store server:
    with S shards, position p's on shard p mod S (control/shards.py); with one store, all."""
    positions = max(1, gpus // max(1, replicas))
    shards = shards_for(gpus) if control_mode(spec) == "cpu" else 0
    return math.ceil(positions / shards) if shards > 1 else positions


def rendezvous_store_s(spec: ScaleSpec, fits: dict[str, Fit], gpus: int, replicas: int) -> float:
    """The busiest store server's serial work for the rebuild's rendezvous after a failure:
    `rendezvous_groups` groups of `replicas` members, each member's requests the curve's
    failure_shard_requests_per_member at that group size (O(1): gloo's address reads batched)
    at the CPU per request, and the value bytes sent to it, failure_shard_bytes_per_member
    (O(R): R addresses), at the CPU per byte. 0 in "wall" mode, or when the curve did not
    measure it."""
    column, nbytes = "failure_shard_requests_per_member", "failure_shard_bytes_per_member"
    if control_mode(spec) == "wall" or column not in fits:
        return 0.0
    curve = spec.curve
    assert curve is not None
    member = fits[column](replicas) * float(curve.request_cpu_s or 0.0)
    if nbytes in fits:
        member += fits[nbytes](replicas) * float(curve.byte_cpu_s or 0.0)
    return rendezvous_groups(spec, gpus, replicas) * replicas * member


def control_plane_s(spec: ScaleSpec, fits: dict[str, Fit], gpus: int) -> float:
    """The failure-free control plane of one step at `gpus` ranks (see `ScaleSpec.control`)."""
    if control_mode(spec) == "wall":
        return fits["control_plane_s"](gpus)
    return fits["control_plane_cpu_s"](gpus) + store_serial_s(spec, fits, gpus)


def expected_losses(p: SimParams) -> float:
    """Replica losses among the active replicas expected over the horizon."""
    if p.per_gpu_mttf_h is None:
        return 0.0
    per_replica = 1.0 - math.exp(-p.gpus_per_replica * (p.budget_h or 0.0) / p.per_gpu_mttf_h)
    return p.replicas * per_replica


def size_params(base: SimParams, gpus: int, seed: int, spec: ScaleSpec) -> SimParams:
    """`base` at `gpus` GPUs with the size-dependent costs, except those the user gave."""
    fits = spec.fits()
    p = replace(base, gpus=gpus, seed=base.seed + seed)
    model = {
        "microbatches": p.microbatches_per_replica * p.replicas,  # weak scaling, no floor
        "restart_cost_s": restart_fit()(gpus),
        "detect_s": fits["detect_s"](gpus),
        "rebuild_s": recover_pause_s(fits, gpus, p.replicas, spec.rebuild)
        + recovery_store_s(spec, fits, gpus) + rendezvous_store_s(spec, fits, gpus, p.replicas),
        "control_plane_s": control_plane_s(spec, fits, gpus),
        "spares": math.ceil(SPARE_FACTOR * expected_losses(p)) + (2 if p.per_gpu_mttf_h else 0),
    }
    return replace(p, **{k: v for k, v in model.items() if k not in spec.given})


@dataclass
class SizeRow:
    """One size's pooled results: ETTR per policy and the costs that produced them."""

    gpus: int
    params: SimParams
    ettr: dict[str, float]
    losses: float  # mean replica losses per seed (recover's run)
    ckpt_interval_steps: int | None = None


def ideal_tokens(p: SimParams) -> float:
    """Tokens failure-free training commits in the horizon (all replicas, no overheads)."""
    return p.n_microbatches * p.tokens_per_microbatch / p.step_time_s * p.budget_s


def run_size(base: SimParams, gpus: int, spec: ScaleSpec) -> SizeRow:
    """Simulate one size over `spec.seeds` seeds; pool the tokens before dividing."""
    tokens = dict.fromkeys(POLICIES, 0.0)
    ideal = losses = 0.0
    p0 = size_params(base, gpus, 0, spec)
    for seed in range(spec.seeds):
        p = size_params(base, gpus, seed, spec)
        res = simulate(p.validate())
        for name, r in res.items():
            tokens[name] += r.committed_tokens
        ideal += ideal_tokens(p)
        losses += res["recover"].replica_losses
    ettr = {name: tokens[name] / ideal for name in POLICIES}
    return SizeRow(gpus, p0, ettr, losses / spec.seeds)


def sweep(base: SimParams, spec: ScaleSpec) -> list[SizeRow]:
    return [run_size(base, g, spec) for g in spec.sizes]


def target_weights(sizes: list[int], target: int = TARGET_GPUS) -> tuple[dict[int, float], str]:
    """How `target` GPUs are read off the sweep: {size: weight} and the rule in words."""
    pts = sorted(set(sizes))
    if not pts:
        raise ValueError("no sizes")
    if target in pts:
        return {target: 1.0}, f"simulated at {target:,} GPUs"
    for g0, g1 in zip(pts, pts[1:], strict=False):
        if g0 < target < g1:
            w = (math.log2(target) - math.log2(g0)) / (math.log2(g1) - math.log2(g0))
            return {g0: 1.0 - w, g1: w}, f"interpolated in log2(GPUs) between {g0:,} and {g1:,}"
    g = min(pts, key=lambda x: abs(math.log2(x) - math.log2(target)))
    return {g: 1.0}, f"the nearest size, {g:,} GPUs (the sweep does not bracket {target:,})"


def at_target(rows: list[SizeRow], policy: str, target: int = TARGET_GPUS) -> float:
    """`policy`'s ETTR at `target` GPUs, read by `target_weights`."""
    w, _ = target_weights([r.gpus for r in rows], target)
    return sum(r.ettr[policy] * w.get(r.gpus, 0.0) for r in rows)
