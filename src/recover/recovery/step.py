"""In-step recovery: the step state machine COMPUTE -> REDUCE -> COMMIT.

Invariants:
- The step's ids are owned by exactly one live replica at a time. Ownership is a chain agreed
  through the store (`step/{t}/chain/{k}`, each entry written once by compare-and-set): entry 0 is
  the plan, entry k>0 hands the ids of replicas missing from generation g_k to the survivors. Every
  replica reads the same chain, so nobody double-counts or drops an id even if replicas saw
  different generations. Entry 0 of step t+1 is *implied*, not stored, when step t's decision is
  `commit` (not `commit-plan`): it is then the plan of the generation t committed in, for the
  speeds in t's reduced trailer, facts every rank of step t+1 holds alike (it read that one
  decision; a joiner or a fresh engine only ever starts at a stored entry 0, because whoever
  writes a decision while a join is pending, or after a fault, writes `commit-plan`).
- The local gradient (unreduced sum of this replica's own microbatches) is never modified before
  commit: reductions work on a copy, so a failed attempt keeps everything computed so far.
- An attempt commits only by a decision written once to the store (`.../decision`), made when every
  surviving member reported that its reduce returned a verified result (trailer: count = N, id
  checksum, step). Survivors of a split outcome therefore never diverge: all apply, or all redo.
- What happens to a lost replica's ids is a `StepStrategy` (`recover.recovery.strategy`): recover's
  in-step recovery by default, or e.g. the shrink-batch baseline; the engine enforces the rest.
- A replica may be a group of ranks (FSDP2 shards, TP x PP ranks): each rank runs this engine
  with its own cross-replica communicator, at its `position`. All ranks of a replica read the same
  chain, so they compute the same ids in the same order (their intra-replica collectives line up);
  outcomes are per (replica, position), and an attempt commits only when every position of every
  surviving replica holds a verified result. A rank whose chain moves past a generation it did not
  reduce in marks that attempt failed at once, so its siblings never wait on it for a decision.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from recover.collectives import FaultTolerantComm, Member, ReplicaFault, keys, shards
from recover.collectives.waiter import KeyWaiter
from recover.recovery.decide import Decisions, RecoveryError, _log
from recover.recovery.grads import GradAccess, TensorGrad
from recover.recovery.strategy import Chain, InStepRecovery, StepStrategy
from recover.recovery.trailer import MAX_REPLICAS, Trailer, carries
from recover.workload import id_checksum

# The reduce carries a trailer (`recover.recovery.trailer`) in the gradient's own buffer when
# its dtype holds it exactly (float32, float64, int64), else beside it in float64; decoded:
# [count, id checksum, step mark, loss sum, seconds per microbatch of replica 0..R-1, slots].
# Every integer in it stays below 2^53, so its sum is exact in any order, within these limits:
MAX_MICROBATCHES = 1 << 20  # count <= N, checksum < 2^32 * N
# MAX_REPLICAS (2^16): step mark = (step + 1) * R < 2^53 for any run of < 2^37 steps
HEAD = 4  # trailer entries before the per-replica speeds
MAX_ATTEMPTS = 32

Hook = Callable[[str, int, int], None]  # (phase, step, local microbatch index)


class BelowMinReplicas(RuntimeError):
    """Fewer live replicas than the user's minimum: the run must stop (after a checkpoint)."""


@dataclass
class StepResult:
    step: int
    generation: int
    members: list[int]
    quotas: dict[int, int]  # microbatches each replica finally contributed
    loss: float  # mean loss over the step's reduced microbatches
    microbatches: int  # verified count in the reduced trailer (= N under in-step recovery)
    recovered: list[int] = field(default_factory=list)  # ids this step recomputed after a fault
    recovery_s: float = 0.0
    attempts: int = 1
    redo: bool = False  # exact mode: the step overflowed its fixed point; run it again
    chain: Chain = field(default_factory=list)  # the ownership chain the step committed on


def _recovered(chain: Chain) -> list[int]:
    """Ids handed to a new owner after a loss (not those first planned after a join)."""
    seen: set[int] = set()
    out: set[int] = set()
    for e in chain:
        ids = {i for v in e["assign"].values() for i in v}
        out |= ids & seen
        seen |= ids
    return sorted(out)


class _CountingStore:
    """Counts the engine's store round trips into `stats["store_ops"]` (for profilers)."""

    def __init__(self, store: Any, stats: dict[str, float]) -> None:
        self._store, self._stats = store, stats

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._stats["store_ops"] += 1
            return attr(*args, **kwargs)

        return call


class StepEngine(Decisions):
    """Runs one rank's side of each step of its replica.

    `grad` is the rank's local gradient: a `GradAccess` (the layout's) or a flat tensor. `positions`
    is the number of ranks per replica; this rank reduces at `comm.position`. `stats` holds
    cumulative counters for profilers ("steps", "attempts", "compute_s", "reduce_s", "decide_s",
    "store_ops"); the phases are also `torch.profiler.record_function` spans ("recover.compute",
    "recover.reduce", "recover.decide").
    """

    def __init__(self, member: Member, comm: FaultTolerantComm, grad: torch.Tensor | GradAccess,
                 n: int, *, min_replicas: int = 1, timeout_s: float = 60.0,
                 hook: Hook | None = None, speed_aware: bool = True, positions: int = 1,
                 strategy: StepStrategy | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        if not 1 <= n <= MAX_MICROBATCHES:
            raise ValueError(f"N={n} microbatches is outside [1, {MAX_MICROBATCHES}], the range "
                             "in which the reduce's verification is exact")
        if member.replicas > MAX_REPLICAS:
            raise ValueError(f"{member.replicas} replicas exceed {MAX_REPLICAS}, the most the "
                             "reduce's verification is exact for")
        if not 0 <= member.replica < member.replicas:
            raise ValueError(f"replica id {member.replica} is not in [0, {member.replicas})")
        self.member, self.comm, self.n = member, comm, n
        self.grads: GradAccess = TensorGrad(grad) if isinstance(grad, torch.Tensor) else grad
        self.positions, self.position = positions, comm.position
        if not 0 <= self.position < positions:
            raise ValueError(f"position {self.position} is not in [0, {positions})")
        self.min_replicas, self.timeout_s = min_replicas, timeout_s
        self.hook = hook or (lambda phase, step, j: None)
        self.speed_aware = speed_aware
        self.strategy: StepStrategy = strategy or InStepRecovery()
        self.me = member.replica
        self.stats: dict[str, float] = dict.fromkeys(
            ("steps", "attempts", "compute_s", "reduce_s", "decide_s", "store_ops"), 0)
        self.store = _CountingStore(member.store, self.stats)
        self.waiter = KeyWaiter(member)
        # With store shards (collectives/shards.py) the failure-free count and decision go
        # through this rank's shard; the main store keeps the decision of record.
        n_shards = len(member.shard_ports)
        self.shard: Any = None
        if n_shards:
            client = member.connect_shard(
                shards.shard_of(self.me, self.position, positions, n_shards))
            self.shard = _CountingStore(client, self.stats)
            self.shard_waiter = KeyWaiter(member, client)
            self.shard_totals = shards.ShardTotals(positions, n_shards)
        self.mb_time: float | None = None  # EMA of this replica's seconds per microbatch
        self.speeds: dict[int, float] = {}  # every replica's, from the last reduced trailer
        # Called with (step, join entry) on every rank when a replica joins at a step boundary
        # (`recover.Replica` serves the joiner its state when this replica is the donor).
        self.on_join: Callable[[int, dict], None] | None = None
        self._served: set[int] = set()
        self.scheduled_joins: dict[int, int] = {}  # fault injection: replica -> step (see above)
        self._proposed: set[int] = set()
        # (step, generation): that step's plan is implied by the commit of the step before it in
        # that generation (see the module docstring); None: the next plan is read from the store.
        self._implied: tuple[int, int] | None = None
        # Speeds are alike on every rank: one rank per replica, or the caller makes each
        # replica's ranks agree on `mb_time` (`recover.Replica` does). Only then may a plan that
        # depends on speeds be implied instead of read from the store.
        self.shared_speeds = positions == 1
        # One gradient-sized scratch buffer, reused by every reduce unless an abandoned
        # operation may still write into it (then a new one is made and this one dropped).
        self.reduce_dtype = reduce_dtype or self.grads.dtype
        # Per-replica trailer values a GradAccess may ask for (exact mode: maxima, overflow).
        self._slots = int(getattr(self.grads, "slots", 0))
        # The trailer rides at the end of the gradient's buffer when that dtype holds it
        # exactly: one collective per step instead of two.
        self._folded = carries(self.reduce_dtype)
        self.trailer = Trailer(member.replicas, self._slots,
                               self.reduce_dtype if self._folded else torch.float64)
        self._scratch: torch.Tensor | None = None

    @property
    def store_waits(self) -> int:
        """Blocking key waits so far: one store round trip each, made on a waiter's helper
        client, which `stats["store_ops"]` does not count."""
        return self.waiter.gets + (self.shard_waiter.gets if self.shard is not None else 0)

    # -- the step --------------------------------------------------------------------------
    def run(self, step: int, compute: Callable[[int, int], float],
            round_: int = 0) -> StepResult:
        """Compute, reduce and agree on step `step`; on return the gradient holds the reduced sum.

        `compute(id, j)` accumulates microbatch `id`'s gradient into the local gradient and returns
        its loss; `j` counts this replica's microbatches within the step (for fault injection).
        `round_` > 0 runs the same step again from scratch (exact mode after an overflow), with
        its own keys in the store.
        """
        tag: int | str = step if round_ == 0 else f"{step}.{round_}"
        chain: Chain = []
        held: list[int] = []
        settled: set[int] = set()  # generations this rank reported an outcome in (multi-rank)
        loss_sum, t_fault, compute_s = 0.0, None, 0.0
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self.stats["attempts"] += 1
            g = self.member.generation()
            members = self.member.members(g)
            if len(members) < self.min_replicas:
                raise BelowMinReplicas(f"{len(members)} live replica(s) {members} < "
                                       f"--min-replicas {self.min_replicas}")
            before = len(chain)
            chain = self._sync_chain(step, tag, chain, g, members)
            if self.positions > 1:
                self._mark_skipped(tag, chain, settled)
            if not self.strategy.keeps_work and before and len(chain) > before:
                self.grads.zero()  # the strategy discards the attempt: start the step over
                held, loss_sum = [], 0.0
            join = chain[-1].get("join")
            if join is not None:
                # A replica joins at this step boundary: the donor's ranks serve it its state
                # (the state after `step` optimizer steps), and nobody computes until the joiner
                # is admitted, or given up, in a newer generation; its entry plans the step.
                if self.on_join is not None and join["epoch"] not in self._served:
                    self._served.add(join["epoch"])
                    self.on_join(step, join)
                if self.member.generation() == chain[-1]["gen"]:
                    try:
                        self.member.wait_newer(chain[-1]["gen"], 3 * self.timeout_s)
                    except TimeoutError:
                        raise RecoveryError(f"step {step}: replica {join['replica']} was neither "
                                            "admitted nor given up in time") from None
                continue
            entries = chain if self.strategy.keeps_work else chain[-1:]
            todo = [i for e in entries for i in e["assign"].get(str(self.me), []) if i not in held]
            t0 = time.monotonic()
            with record_function("recover.compute"):
                for i in todo:
                    loss_sum += compute(i, len(held))
                    held.append(i)
            compute_s += time.monotonic() - t0 if todo else 0.0
            self.stats["compute_s"] += time.monotonic() - t0
            entry_gen = chain[-1]["gen"]
            newest = self.member.generation()
            if newest < entry_gen:
                self.member.wait_newer(newest, self.timeout_s)
                continue
            if newest > entry_gen:
                t_fault = t_fault or time.monotonic()
                continue  # extend the chain to the newest generation before reducing
            owners = self.strategy.owners(chain)
            t0 = time.monotonic()
            with record_function("recover.reduce"):
                out, trailer, ok = self._reduce(step, entry_gen, held, loss_sum, sorted(owners))
            self.stats["reduce_s"] += time.monotonic() - t0
            self.hook("commit", step, len(held))
            settled.add(entry_gen)
            t0 = time.monotonic()
            with record_function("recover.decide"):
                decision = self._decide(step, tag, entry_gen, ok)
            self.stats["decide_s"] += time.monotonic() - t0
            if decision in keys.COMMITS:
                self._implied = (step + 1, entry_gen) if decision == keys.COMMIT else None
                count = int(trailer[0])
                scale = self.strategy.scale(count, self.n)
                if scale != 1.0:
                    out.mul_(scale)
                self.grads.assign(out)
                reps = self.member.replicas
                self.speeds = {r: v for r, v in enumerate(trailer[HEAD:HEAD + reps].tolist())
                               if v > 0}
                redo = bool(self._slots) and self.grads.agree(  # type: ignore[attr-defined]
                    trailer[HEAD + reps:].view(reps, self._slots))
                self._record_speed(compute_s, len(held))
                self.stats["steps"] += 1
                quotas: dict[int, int] = {}
                for o in owners.values():
                    quotas[o] = quotas.get(o, 0) + 1
                recovered = _recovered(chain) if self.strategy.keeps_work else []
                return StepResult(step, entry_gen, self.member.members(entry_gen),
                                  dict(sorted(quotas.items())), float(trailer[3]) / count, count,
                                  recovered, time.monotonic() - t_fault if t_fault else 0.0,
                                  attempt, redo, chain)
            t_fault = t_fault or time.monotonic()
            _log(f"replica {self.me} position {self.position}: step {tag} attempt {attempt} in "
                 f"generation {entry_gen}: reduce {'ok' if ok else 'failed'}, decision "
                 f"{decision.decode(errors='replace')}; newest generation "
                 f"{self.member.generation()}")
            if self.member.generation() == entry_gen:
                self.member.wait_newer(entry_gen, self.timeout_s)
        raise RecoveryError(f"step {step} did not commit after {MAX_ATTEMPTS} attempts")

    # -- reduce and verify -------------------------------------------------------------------
    def _reduce(self, step: int, g: int, held: list[int], loss_sum: float, expect_ids: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Reduce a copy of the kept local gradient, and the trailer; ok iff the sum verifiably
        holds exactly `expect_ids` of this step from every member of g."""
        numel = self.grads.numel
        buf = self._scratch_buffer()
        out = buf[:numel]
        self.grads.pack(out)
        tail = buf[numel:] if self._folded else torch.empty(
            self.trailer.size, dtype=torch.float64, device=buf.device)
        slots = self.grads.slot_values() if self._slots else []  # type: ignore[attr-defined]
        self.trailer.encode(tail, (len(held), id_checksum(held), step + 1), self.me,
                            [loss_sum, self.mb_time or 0.0, *slots])
        try:
            self.comm.reduce_([buf] if self._folded else [out, tail], g,
                              on_issued=lambda: self.hook("reduce", step, len(held)))
        except ReplicaFault:
            return out, tail, False
        trailer = self.trailer.decode(tail)
        size = len(self.member.members(g))
        expect = (len(expect_ids), id_checksum(expect_ids), (step + 1) * size)
        got = tuple(int(x) for x in trailer[:3].tolist())
        if got != expect:
            self.member.report_fail(g)  # a wrong count is never committed; rebuild and redo
            return out, trailer, False
        return out, trailer, True

    def _scratch_buffer(self) -> torch.Tensor:
        s = self._scratch
        if s is None or self.comm.in_use(s):
            self._scratch = None  # drop ours first: at most one such buffer is ours at a time
            size = self.grads.numel + (self.trailer.size if self._folded else 0)
            s = self._scratch = torch.empty(size, dtype=self.reduce_dtype,
                                            device=self.grads.device)
        return s

    def _sync_chain(self, step: int, tag: int | str, chain: Chain, g: int, members: list[int]
                    ) -> Chain:
        """Read the agreed ownership chain up to an entry of generation >= g, extending it if
        nobody has yet. Entry 0, the step's plan, is proposed by one rank (position 0 of the
        lowest member); the others block on it. Later entries (after a fault) are proposed by
        whoever needs them first. Entry 0 is implied instead when the last commit says so."""
        chain = list(chain)
        implied, self._implied = self._implied, None
        if not chain and implied is not None and implied[0] == tag:
            chain.append(self._plan_entry(step, implied[1], self.member.members(implied[1])))
        deadline = time.monotonic() + 3 * self.timeout_s
        while not chain or chain[-1]["gen"] < g:
            key = keys.chain_key(tag, len(chain))
            proposer = bool(chain) or (self.position == 0 and self.me == min(members))
            if proposer:
                raw = self.store.compare_set(key, "", json.dumps(self._propose(step, chain, g,
                                                                               members)))
            else:
                raw = self.waiter.get(key, g, max(0.0, deadline - time.monotonic()))
                if raw is None:  # the membership changed meanwhile: maybe we propose now
                    self.member.check()
                    if time.monotonic() > deadline:
                        raise RecoveryError(f"no plan for step {step} within "
                                            f"{3 * self.timeout_s:.0f}s")
                    g = self.member.generation()
                    members = self.member.members(g)
                    continue
            chain.append(json.loads(raw))
        return chain

    def _propose(self, step: int, chain: Chain, g: int, members: list[int]) -> dict:
        if not chain:
            self._await_scheduled_join(step, members)
        # A copy (one C-level operation): the liveness thread adds and removes entries.
        waiting = sorted(dict(self.member.join_requests).items(), key=lambda kv: kv[1]) \
            if not chain else []
        for joiner, (epoch, at) in waiting:  # one join per boundary, oldest first
            if joiner not in members and epoch not in self._proposed and step >= at:
                # Admit at this boundary: the step waits for the joiner (see `run`), served by us.
                self._proposed.add(epoch)
                return {"gen": g, "assign": {},
                        "join": {"replica": joiner, "epoch": epoch, "donor": self.me}}
        return self._plan_entry(step, g, members, chain)

    def _plan_entry(self, step: int, g: int, members: list[int], chain: Chain | None = None
                    ) -> dict:
        """The chain entry after `chain` in generation g, as stored (JSON-shaped)."""
        speeds = ({m: self.speeds[m] for m in members if m in self.speeds}
                  if self.speed_aware else None)
        assign = self.strategy.assign(step, self.n, chain or [], members, speeds)
        return {"gen": g, "assign": {str(m): ids for m, ids in assign.items() if ids}}

    def _await_scheduled_join(self, step: int, members: list[int]) -> None:
        """Fault injection (`restart:replica=R,step=S`): at boundary S the plan waits, bounded,
        for replica R's replacement to register, so the scenario is reproducible. A real
        replacement is not waited for: it joins at the first boundary after it registered."""
        for replica, at in self.scheduled_joins.items():
            if step != at or replica in members:
                continue
            # Shorter than the others' wait for this plan (3 x timeout): if the replacement
            # never registers (it died too), they get a plan without it, not a timeout.
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline and not self.member.coordinator_lost:
                if replica in self.member.join_requests:
                    return
                self.member.progress()
                time.sleep(0.01)

    # -- speeds ------------------------------------------------------------------------------
    def _record_speed(self, compute_s: float, count: int) -> None:
        """This replica's seconds per microbatch (an EMA), sent in the next reduce's trailer."""
        if count == 0 or compute_s <= 0:
            return
        t = compute_s / count
        self.mb_time = t if self.mb_time is None else 0.7 * self.mb_time + 0.3 * t
