"""In-step recovery: the step state machine COMPUTE -> REDUCE -> COMMIT.

Invariants:
- The step's ids are owned by exactly one live replica at a time: the ownership chain agreed
  through the store (recovery/chain.py) says who owns which; every replica reads the same chain.
- The local gradient (unreduced sum of this replica's own microbatches) is never modified before
  commit: reductions work on a copy, so a failed attempt keeps everything computed so far.
- An attempt commits only by a decision written once to the store (recovery/decide.py), made when
  every surviving member reported that its reduce returned a verified result (trailer: count = N,
  id checksum, step). Survivors of a split outcome therefore never diverge: all apply, or all redo.
- What happens to a lost replica's ids is a `StepStrategy` (`recover.recovery.strategy`): recover's
  in-step recovery by default, or e.g. the shrink-batch baseline; the engine enforces the rest.
- A replica may be a group of ranks (FSDP2 shards, TP x PP ranks): each rank runs this engine
  with its own cross-replica communicator, at its `position`. All ranks of a replica read the same
  chain, so they compute the same ids in the same order (their intra-replica collectives line up);
  outcomes are per (replica, position), and an attempt commits only when every position of every
  surviving replica holds a verified result. A rank whose chain moves past a generation it did not
  reduce in marks that attempt failed at once, so its siblings never wait on it for a decision.
- The keys a step leaves in the store are deleted two commits later (recovery/lifetime.py).
- Over a layout that reports finished gradients, the reduce runs in buckets, the ones the last
  microbatch's backward finishes issued from inside it (recovery/buckets.py); every member issues
  the same operations in the same order whether it overlapped or not, and an attempt that moves
  to a newer generation abandons what it issued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from recover.collectives import FaultTolerantComm, ReplicaFault
from recover.collectives.comm import Flight
from recover.control import Member, keys
from recover.control.storecount import CountedStore, Tally
from recover.control.waiter import KeyWaiter
from recover.recovery.buckets import BucketPlan, Overlap, StreamedGrad
from recover.recovery.chain import OwnershipChain
from recover.recovery.decide import CommitDecision
from recover.recovery.failures import BelowMinReplicas, CommitRefused, RecoveryError
from recover.recovery.grads import GradAccess, TensorGrad
from recover.recovery.lifetime import Committed, KeyLifetime
from recover.recovery.speaker import ReplicaLink
from recover.recovery.strategy import Chain, InStepRecovery, StepStrategy
from recover.recovery.trailer import MAX_REPLICAS, Trailer, carries
from recover.settings import FaultTolerance, Hooks, Numerics
from recover.workload import id_checksum, step_ids

log = logging.getLogger(__name__)

# The reduce carries a trailer (`recover.recovery.trailer`) in the gradient's own buffer when
# its dtype holds it exactly (float32, float64, int64), else beside it in float64; decoded:
# [count, id checksum, step mark, loss sum, seconds per microbatch of replica 0..R-1, slots].
# Every integer in it stays below 2^53, so its sum is exact in any order, within these limits:
MAX_MICROBATCHES = 1 << 20  # count <= N, checksum < 2^32 * N
# MAX_REPLICAS (2^16): step mark = (step + 1) * R < 2^53 for any run of < 2^37 steps
HEAD = 4  # trailer entries before the per-replica speeds
MAX_ATTEMPTS = 32
# Numerics.reduce_dtype's names ("": the gradient's own dtype).
REDUCE_DTYPES: dict[str, torch.dtype | None] = {
    "": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = ["HEAD", "MAX_ATTEMPTS", "MAX_MICROBATCHES", "REDUCE_DTYPES", "BelowMinReplicas",
           "RecoveryError", "StepEngine", "StepResult"]


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


@dataclass
class _Progress:
    """One `run`'s state across its attempts."""

    tag: int | str  # the step's name in the store
    chain: Chain = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # ids computed into the local gradient
    settled: set[int] = field(default_factory=set)  # generations this rank reported in
    loss_sum: float = 0.0
    compute_s: float = 0.0
    t_fault: float | None = None  # when the first attempt failed
    implied: bool = False  # entry 0 of the chain was implied, not read from the store
    flight: Flight | None = None  # buckets issued inside this attempt's last backward


def _recovered(chain: Chain) -> list[int]:
    """Ids handed to a new owner after a loss (not those first planned after a join)."""
    seen: set[int] = set()
    out: set[int] = set()
    for e in chain:
        ids = {i for v in e["assign"].values() for i in v}
        out |= ids & seen
        seen |= ids
    return sorted(out)


class StepEngine:
    """Runs one rank's side of each step of its replica.

    `grad` is the rank's local gradient: a `GradAccess` (the layout's) or a flat tensor.
    The replica's ranks (`member.nranks`) are its positions; this rank reduces at
    `comm.position`.
    `shared_speeds`: every rank of a replica holds the same speeds (default: one rank per
    replica; `recover.Replica` makes its ranks agree), so a speed-aware plan may be implied.
    `stats` holds cumulative counters for profilers ("steps", "attempts", "compute_s",
    "reduce_s", "decide_s", "store_ops", "store_deletes"); the phases are also
    `torch.profiler.record_function` spans ("recover.compute", "recover.reduce",
    "recover.decide"). `on_join(step, entry)` is called on every rank when a replica joins at a
    step boundary (`recover.Replica` serves the joiner its state when this replica is the donor).
    `prefetch(step + 1, ids)`, if set, is called while this rank's verified result waits for
    the commit decision, with the ids it most likely computes next (their data may load then).
    `link`: with positions > 1, the replica's own agreement (`ReplicaLink`): its position 0 then
    speaks for it to the store (recovery/speaker.py).
    """

    def __init__(self, member: Member, comm: FaultTolerantComm, grad: torch.Tensor | GradAccess,
                 n: int, *, ft: FaultTolerance | None = None,
                 numerics: Numerics | None = None, hooks: Hooks | None = None,
                 strategy: StepStrategy | None = None,
                 shared_speeds: bool | None = None, link: ReplicaLink | None = None) -> None:
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
        positions = member.nranks  # the replica's ranks: one per position
        self.positions, self.position = positions, comm.position
        if not 0 <= self.position < positions:
            raise ValueError(f"position {self.position} is not in [0, {positions})")
        self.ft = ft or FaultTolerance()
        self.hooks = hooks or Hooks()
        self.strategy: StepStrategy = strategy or InStepRecovery()
        self.me = member.replica
        self.stats: dict[str, float] = dict.fromkeys(
            ("steps", "attempts", "compute_s", "reduce_s", "decide_s", "store_ops",
             "store_deletes"), 0)
        # Every request of the step's critical path (the chain, the count, the decision, the
        # evidence) goes through a client counted here, so `stats["store_ops"]` is exactly those
        # round trips; blocking key waits run on the waiter's own client (`store_waits`), and
        # key deletions off the critical path on the key lifetime's (`stats["store_deletes"]`).
        self.requests = Tally(stats=self.stats)
        store = CountedStore(member.store, self.requests, "main")
        self.waiter = KeyWaiter(member)
        self.chains = OwnershipChain(member, store, self.waiter, self.strategy, n,
                                     self.position, positions, self.ft, self.hooks, link)
        if shared_speeds is not None:
            self.chains.shared_speeds = shared_speeds
        self.decision = CommitDecision(member, store, self.waiter, self.position, positions,
                                       self.ft.reduce_timeout_s, self.chains.commit_value,
                                       self.requests, link)
        self.lifetime = KeyLifetime(member, self.position, positions, self.stats,
                                    speaker=self.decision.link is not None)
        self.mb_time: float | None = None  # EMA of this replica's seconds per microbatch
        self.on_join: Callable[[int, dict], None] | None = None
        # (next step, ids): called while a verified rank waits for the commit decision.
        self.prefetch: Callable[[int, list[int]], None] | None = None
        self._served: set[int] = set()
        numerics = numerics or Numerics()
        # One gradient-sized scratch buffer, reused by every reduce unless an abandoned
        # operation may still write into it (then a new one is made and this one dropped).
        self.reduce_dtype = (None if numerics.exact else REDUCE_DTYPES[numerics.reduce_dtype]
                             ) or self.grads.dtype
        # Per-replica trailer values a GradAccess may ask for (exact mode: maxima, overflow).
        self._slots = int(getattr(self.grads, "slots", 0))
        # The trailer rides at the end of the gradient's buffer when that dtype holds it
        # exactly: one collective per step instead of two.
        self._folded = carries(self.reduce_dtype)
        self.trailer = Trailer(member.replicas, self._slots,
                               self.reduce_dtype if self._folded else torch.float64)
        self._scratch: torch.Tensor | None = None
        # The reduction's operations (`recover.recovery.buckets`): buckets over a layout that
        # reports finished parameters, issued while the last microbatch's backward runs; else
        # one operation.
        self._stream = (isinstance(self.grads, StreamedGrad) and numerics.bucket_mb > 0
                        and not numerics.exact)
        elem = torch.empty((), dtype=self.reduce_dtype).element_size()
        self.buckets = (BucketPlan.make(self.grads.sizes, elem, numerics.bucket_mb)  # type: ignore[attr-defined]
                        if self._stream else BucketPlan.make([self.grads.numel], elem, 0))

    @property
    def speeds(self) -> dict[int, float]:
        """Every replica's seconds per microbatch, from the last reduced trailer."""
        return self.chains.speeds

    @speeds.setter
    def speeds(self, value: dict[int, float]) -> None:
        self.chains.speeds = dict(value)

    @property
    def shared_speeds(self) -> bool:
        """Every rank of this replica holds the same speeds (see the class docstring)."""
        return self.chains.shared_speeds

    @shared_speeds.setter
    def shared_speeds(self, value: bool) -> None:
        self.chains.shared_speeds = value

    @property
    def store_waits(self) -> int:
        """Blocking key waits so far: one store round trip each, made on a waiter's helper
        client, which `stats["store_ops"]` does not count."""
        return self.decision.waits

    def close(self) -> None:
        """Stop the background deletion of old steps' keys and the key waits' helper threads
        (idempotent)."""
        self.lifetime.close()
        self.waiter.close()
        self.decision.close()

    # -- the step --------------------------------------------------------------------------
    def run(self, step: int, compute: Callable[[int, int], float],
            round_: int = 0) -> StepResult:
        """Compute, reduce and agree on step `step`; on return the gradient holds the reduced sum.

        `compute(id, j)` accumulates microbatch `id`'s gradient into the local gradient and returns
        its loss; `j` counts this replica's microbatches within the step (for fault injection).
        `round_` > 0 runs the same step again from scratch (exact mode after an overflow), with
        its own keys in the store.
        """
        p = _Progress(step if round_ == 0 else f"{step}.{round_}")
        for attempt in range(1, MAX_ATTEMPTS + 1):
            self.stats["attempts"] += 1
            if not self._extend_chain(step, p):
                continue
            entry_gen = p.chain[-1]["gen"]
            self._compute(p, compute, step, entry_gen)
            newest = self.member.generation()
            if newest != entry_gen and p.flight is not None:
                self.comm.abandon(p.flight)  # its buckets can no longer commit
                p.flight = None
            if newest < entry_gen:
                self.member.wait_newer(newest, self.ft.reduce_timeout_s)
                continue
            if newest > entry_gen:
                p.t_fault = p.t_fault or time.monotonic()
                continue  # extend the chain to the newest generation before reducing
            owners = self.strategy.owners(p.chain)
            t0 = time.monotonic()
            with record_function("recover.reduce"):
                out, trailer, ok = self._reduce(step, entry_gen, p, sorted(owners))
            self.stats["reduce_s"] += time.monotonic() - t0
            self.hooks.phase("commit", step, len(p.held))
            p.settled.add(entry_gen)
            t0 = time.monotonic()
            with record_function("recover.decide"):
                decision = self.decision.decide(step, p.tag, entry_gen, ok,
                                                self._meanwhile(step, entry_gen, trailer, ok))
            self.stats["decide_s"] += time.monotonic() - t0
            if keys.is_commit(decision):
                if not ok:  # unreachable by the protocol: see CommitRefused
                    raise CommitRefused(
                        f"replica {self.me} position {self.position}: step {p.tag} in "
                        f"generation {entry_gen} was decided {decision.decode(errors='replace')!r}"
                        " but this rank's reduce failed; it never applies a step it holds no "
                        "verified sum for (a decision key written outside the protocol?)")
                return self._commit(step, p, decision, out, trailer, owners, attempt)
            p.t_fault = p.t_fault or time.monotonic()
            log.warning("replica %d position %d: step %s attempt %d in generation %d: reduce "
                        "%s, decision %s; newest generation %d", self.me, self.position, p.tag,
                        attempt, entry_gen, "ok" if ok else "failed",
                        decision.decode(errors="replace"), self.member.generation())
            if self.member.generation() == entry_gen:
                self.member.wait_newer(entry_gen, self.ft.reduce_timeout_s)
        raise RecoveryError(f"step {step} did not commit after {MAX_ATTEMPTS} attempts")

    def _meanwhile(self, step: int, g: int, trailer: torch.Tensor, ok: bool
                   ) -> Callable[[], None] | None:
        """What this rank may do while the decision travels: hand `prefetch` the ids it most
        likely computes in the next step (their data loads). Nothing is applied: a guess the
        decision turns out to contradict costs only the loads."""
        prefetch = self.prefetch
        if prefetch is None or not ok:
            return None
        ids = self.chains.predict(step + 1, g, self._speeds(trailer))
        return (lambda: prefetch(step + 1, ids)) if ids else None

    def _speeds(self, trailer: torch.Tensor) -> dict[int, float]:
        """Every replica's seconds per microbatch, as a decoded trailer carries them."""
        reps = self.member.replicas
        return {r: v for r, v in enumerate(trailer[HEAD:HEAD + reps].tolist()) if v > 0}

    def _extend_chain(self, step: int, p: _Progress) -> bool:
        """Bring the chain up to the newest generation; False when this attempt computes
        nothing (a join is served at this boundary: wait for its generation, then again)."""
        g = self.member.generation()
        members = self.member.members(g)
        if len(members) < self.ft.min_replicas:
            raise BelowMinReplicas(f"{len(members)} live replica(s) {members} < "
                                   f"--min-replicas {self.ft.min_replicas}")
        before = len(p.chain)
        p.chain = self.chains.sync(step, p.tag, p.chain, g, members,
                                   lambda gen: self.decision.skip(p.tag, gen, p.settled))
        if not before:
            p.implied = self.chains.first_implied
        if self.positions > 1:
            self.decision.mark_skipped(p.tag, p.chain, p.settled)
        if not self.strategy.keeps_work and before and len(p.chain) > before:
            self.grads.zero()  # the strategy discards the attempt: start the step over
            p.held, p.loss_sum = [], 0.0
        join = p.chain[-1].get("join")
        if join is None:
            return True
        # A replica joins at this step boundary: the donor's ranks serve it its state (the state
        # after `step` optimizer steps), and nobody computes until the joiner is admitted, or
        # given up, in a newer generation; its entry plans the step.
        if self.on_join is not None and join["epoch"] not in self._served:
            self._served.add(join["epoch"])
            self.on_join(step, join)
        if self.member.generation() == p.chain[-1]["gen"]:
            try:
                self.member.wait_newer(p.chain[-1]["gen"], 3 * self.ft.reduce_timeout_s)
            except TimeoutError:
                raise RecoveryError(f"step {step}: replica {join['replica']} was neither "
                                    "admitted nor given up in time") from None
        return False

    def _compute(self, p: _Progress, compute: Callable[[int, int], float], step: int,
                 g: int) -> None:
        """Compute the ids this replica owns in the chain and does not hold yet; during the last
        one's backward, reduce the buckets it finishes in g (`_overlap`)."""
        entries = p.chain if self.strategy.keeps_work else p.chain[-1:]
        todo = [i for e in entries for i in e["assign"].get(str(self.me), []) if i not in p.held]
        t0 = time.monotonic()
        try:
            with record_function("recover.compute"):
                for n, i in enumerate(todo):
                    overlap = self._overlap(p, step, g, len(p.held)) if n == len(todo) - 1 else None
                    try:
                        p.loss_sum += compute(i, len(p.held))
                    finally:
                        if overlap is not None:
                            self.grads.on_final(None)  # type: ignore[attr-defined]
                    if overlap is not None:
                        overlap.flush()  # parameters this microbatch left without a gradient
                    p.held.append(i)
        except BaseException:
            if p.flight is not None:  # nobody will complete it: end its operations
                self.comm.abandon(p.flight)
                p.flight = None
            raise
        p.compute_s += time.monotonic() - t0 if todo else 0.0
        self.stats["compute_s"] += time.monotonic() - t0

    def _overlap(self, p: _Progress, step: int, g: int, j: int) -> Overlap | None:
        """Arm the buckets of the microbatch about to run (the attempt's last): each is reduced
        in g as soon as its parameters' gradients are final, while the backward goes on. Only
        with a layout that reports them, more than one bucket, and g's group ready now (a
        rebuild or a fault is never waited on from inside a backward)."""
        if not self._stream or len(self.buckets.ranges) < 2 or not self.comm.ready(g):
            return None
        buf = self._scratch_buffer()
        t = self.trailer.size if self._folded else 0
        flat = self.grads.local_flat()  # type: ignore[attr-defined]
        flight = p.flight = self.comm.open(g, [buf])
        overlap = Overlap(self.buckets, lambda lo, hi: self._issue(flight, buf[t + lo:t + hi],
                                                                   flat[lo:hi]),
                          lambda: self.hooks.phase("bucket", step, j))
        self.grads.on_final(overlap.ready)  # type: ignore[attr-defined]
        return overlap

    def _issue(self, flight: Flight, into: torch.Tensor, src: torch.Tensor) -> None:
        """Pack one bucket of the local gradient into the scratch buffer and start its sum."""
        with torch.no_grad():
            into.copy_(src)
        self.comm.issue(flight, into)

    def _commit(self, step: int, p: _Progress, decision: bytes, out: torch.Tensor,
                trailer: torch.Tensor, owners: dict[int, int], attempt: int) -> StepResult:
        """Apply a committed attempt: the reduced sum into the gradient, the speeds it carried."""
        g = p.chain[-1]["gen"]
        self.chains.committed(step, g, decision)
        count = int(trailer[0])
        scale = self.strategy.scale(count, self.n)
        if scale != 1.0:
            out.mul_(scale)
        self.grads.assign(out)
        reps = self.member.replicas
        self.chains.speeds = self._speeds(trailer)
        redo = bool(self._slots) and self.grads.agree(  # type: ignore[attr-defined]
            trailer[HEAD + reps:].view(reps, self._slots))
        self._record_speed(p.compute_s, len(p.held))
        self.stats["steps"] += 1
        quotas: dict[int, int] = {}
        for o in owners.values():
            quotas[o] = quotas.get(o, 0) + 1
        members = self.member.members(g)
        self.lifetime.committed(Committed(p.tag, p.chain, p.implied, g, members,
                                          self.member.generation()))
        recovered = _recovered(p.chain) if self.strategy.keeps_work else []
        recovery_s = time.monotonic() - p.t_fault if p.t_fault else 0.0
        if attempt > 1 or recovered:
            log.info("replica %d: step %s committed in generation %d after %d attempt(s), %d "
                     "microbatch(es) recomputed in %.2fs", self.me, p.tag, g, attempt,
                     len(recovered), recovery_s)
        else:
            log.debug("replica %d: step %s committed in generation %d", self.me, p.tag, g)
        return StepResult(step, g, members, dict(sorted(quotas.items())),
                          float(trailer[3]) / count, count, recovered, recovery_s, attempt, redo,
                          p.chain)

    # -- reduce and verify -------------------------------------------------------------------
    def _reduce(self, step: int, g: int, p: _Progress, expect_ids: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Reduce a copy of the kept local gradient, and the trailer; ok iff the sum verifiably
        holds exactly `expect_ids` of this step from every member of g. The buckets the last
        backward issued (`p.flight`) are part of it; the others are issued now, the first one
        last, with the trailer."""
        numel, held = self.grads.numel, p.held
        flight, p.flight = p.flight, None
        t = self.trailer.size if self._folded else 0
        buf = flight.hold[0] if flight is not None else self._scratch_buffer()
        out = buf[t:t + numel]
        tail = buf[:t] if self._folded else torch.empty(
            self.trailer.size, dtype=torch.float64, device=buf.device)
        ranges = self.buckets.ranges
        last = ranges[-1][1]  # the first bucket: elements [0, last), issued last
        done = 0
        if flight is None:
            self.grads.pack(out)
        else:  # the backward issued every bucket but the first (`Overlap.flush`): pack it
            done = len(ranges) - 1
            out[:last].copy_(self.grads.local_flat()[:last])  # type: ignore[attr-defined]
        slots = self.grads.slot_values() if self._slots else []  # type: ignore[attr-defined]
        self.trailer.encode(tail, (len(held), id_checksum(held), step + 1), self.me,
                            [p.loss_sum, self.mb_time or 0.0, *slots])
        ops = [out[lo:hi] for lo, hi in ranges[done:-1]]
        ops += [buf[:t + last]] if self._folded else [out[:last], tail]
        try:
            if flight is None:
                flight = self.comm.open(g, [buf] if self._folded else [buf, tail])
            else:
                flight.hold.append(tail)
            for op in ops:
                self.comm.issue(flight, op)
            self.comm.complete(flight, on_issued=lambda: self.hooks.phase("reduce", step,
                                                                          len(held)))
        except ReplicaFault:
            return out, tail, False
        trailer = self.trailer.decode(tail)
        size = len(self.member.members(g))
        # Against the step's own ids (its definition), not only the chain read from the store.
        want = step_ids(step, self.n) if self.strategy.keeps_work else expect_ids
        expect = (len(want), id_checksum(want), (step + 1) * size)
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

    # -- speeds ------------------------------------------------------------------------------
    def _record_speed(self, compute_s: float, count: int) -> None:
        """This replica's seconds per microbatch (an EMA), sent in the next reduce's trailer."""
        if count == 0 or compute_s <= 0:
            return
        t = compute_s / count
        self.mb_time = t if self.mb_time is None else 0.7 * self.mb_time + 0.3 * t
