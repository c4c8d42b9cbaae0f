"""Discrete-event core shared by the three policies: replica slots, fault delivery, accounting.

Invariant: time only moves forward; every fault of the schedule with a time before the policy's
current horizon is applied exactly once and in time order (the replica slot dies, its GPUs stop
being charged); a policy commits a step only if no fault that hits an active replica struck before
the step's end, or (recover) after the step has absorbed that fault. The three policies see the same
`FaultSchedule`; `engine.simulate()` runs each from a fresh `Job`.

Imports run one way: `engine` -> `policies` -> `job` (this module); nothing here imports the event
loops, so the policies can share `Job`, `replica_quotas` and `ceil_div` without a cycle.
"""

from __future__ import annotations

import bisect
import math

from recover.app.sim.faults import Fault, FaultSchedule
from recover.app.sim.params import SimParams
from recover.app.sim.results import PolicyResult


def replica_quotas(active: list[int], n: int) -> dict[int, int]:
    """Even quotas of `n` microbatches over the sorted active slots (first n % r get one more)."""
    r = len(active)
    return {s: n // r + (1 if i < n % r else 0) for i, s in enumerate(sorted(active))}


class Job:
    """State of one policy's run: members, spares, pending faults, clock and counters."""

    def __init__(self, p: SimParams, sched: FaultSchedule, policy: str) -> None:
        self.p, self.sched, self.policy = p, sched, policy
        r = p.replicas
        self.active = list(range(r))
        self.spare_pool = list(range(r, r + p.spares))
        self.joining: list[tuple[float, int]] = []  # (ready time, slot)
        self.dead: set[int] = set()
        self.deaths: list[float] = []
        self._death_sum = 0.0
        self.timed = sched.timed
        self.i = 0
        self.pending_steps = list(sched.steps)
        # Step faults turned into timed ones (slot -1: the highest active slot).
        self.injected: list[Fault] = []
        self.t = p.startup_s
        self.end = p.startup_s + p.budget_s
        self.steps = 0
        self.committed = 0
        self.processed = 0
        self.res = PolicyResult(
            policy=policy,
            wall_s=0.0,
            steps=0,
            committed_mb=0,
            processed_mb=0,
            gpu_hours=0.0,
            tokens_per_microbatch=p.tokens_per_microbatch,
            microbatches=p.n_microbatches,
            gpus_per_replica=p.gpus_per_replica,
            n_slots=r + p.spares,
            min_batch_mb=p.n_microbatches,
        )
        self.record()

    # -- faults ---------------------------------------------------------------------------------
    def _next(self) -> Fault | None:
        a = self.timed[self.i] if self.i < len(self.timed) else None
        b = self.injected[0] if self.injected else None
        if a is None or (b is not None and b.time_s < a.time_s):
            return b
        return a

    def _pop(self, f: Fault) -> None:
        if self.injected and f is self.injected[0]:
            self.injected.pop(0)
        else:
            self.i += 1

    def kill(self, f: Fault) -> int | None:
        """Apply fault `f`; return the active slot it removed, or None (spare/already dead)."""
        slot = f.slot
        if slot == -1:
            if not self.active:
                return None
            slot = max(self.active)
        if slot in self.dead:
            return None
        self.dead.add(slot)
        self.deaths.append(f.time_s)
        self._death_sum += f.time_s
        self.joining = [(t, s) for t, s in self.joining if s != slot]
        if slot in self.spare_pool:
            self.spare_pool.remove(slot)
        if slot not in self.active:
            return None
        self.active.remove(slot)
        self.res.replica_losses += 1
        self.res.fault_times_s.append(f.time_s)
        return slot

    def next_loss(self, until: float) -> tuple[Fault, int] | None:
        """Apply faults striking before `until` until one removes an active replica; return it."""
        while (f := self._next()) is not None and f.time_s < until:
            self._pop(f)
            slot = self.kill(f)
            if slot is not None:
                return f, slot
        return None

    def inject(self, step: int, compute_s: float) -> None:
        """Turn step faults for `step` (first attempt only) into timed faults inside this step."""
        while self.pending_steps and self.pending_steps[0] <= step:
            self.pending_steps.pop(0)
            f = Fault(self.t + self.p.fault_offset_frac * compute_s, -1)
            bisect.insort(self.injected, f, key=lambda x: x.time_s)

    # -- spares ---------------------------------------------------------------------------------
    def request_spare(self, t_loss: float) -> int | None:
        """Reserve a spare to replace a replica lost at `t_loss`; it is ready after the delay."""
        if not self.spare_pool:
            return None
        slot = self.spare_pool.pop(0)
        self.joining.append((t_loss + self.p.replace_delay_s, slot))
        return slot

    def admit(self) -> None:
        """At a step boundary, spares whose delay has passed join the members."""
        ready = [s for t, s in self.joining if t <= self.t]
        if ready:
            self.joining = [(t, s) for t, s in self.joining if s not in ready]
            self.active = sorted(self.active + ready)

    # -- accounting -----------------------------------------------------------------------------
    def record(self) -> None:
        tok = self.p.tokens_per_microbatch
        t = min(self.t, self.end)
        self.res.series.append((t, self._gpu_h(t), self.committed * tok, self.processed * tok))

    def _gpu_h(self, t: float) -> float:
        if self.deaths and self.deaths[-1] <= t:  # deaths are appended in time order
            lost = len(self.deaths) * t - self._death_sum
        else:
            lost = sum(t - d for d in self.deaths if d < t)
        return self.p.gpus_per_replica * (self.res.n_slots * t - lost) / 3600.0

    def free_steps(self, st: float) -> int:
        """Whole steps of length `st` that surely run untouched (no fault, join, or end).

        A pending join bounds them like a fault: the steps end at or before its ready time, so the
        spare is admitted at the same step boundary as when stepping one by one (large jobs have a
        join pending much of the time).
        """
        f = self._next()
        joins = min((t for t, _ in self.joining), default=math.inf)
        limit = min(self.end, f.time_s if f is not None else math.inf, joins)
        if math.isinf(limit):
            m = 10**12
        else:
            m = max(0, math.floor((limit - self.t) / st))
            while m > 0 and self.t + m * st > limit:
                m -= 1
        if self.p.total_steps is not None:
            m = min(m, self.p.total_steps - self.steps)
        if self.pending_steps:
            m = min(m, self.pending_steps[0] - self.steps)
        return max(0, m)

    def advance(self, m: int, st: float, batch: int) -> None:
        """Commit `m` fault-free steps of length `st` and `batch` microbatches each."""
        self.t += m * st
        self.steps += m
        self.committed += m * batch
        self.processed += m * batch
        self.record()

    def over_budget(self, t: float) -> bool:
        """True (and the clock stops at the budget) when `t` passes the wall-clock budget."""
        if t > self.end:
            self.t = self.end
            self.res.stop_reason = "budget"
            return True
        return False

    def too_few(self) -> bool:
        if len(self.active) < self.p.min_replicas:
            self.res.stop_reason = (
                f"{len(self.active)} replica(s) left (< min {self.p.min_replicas})"
            )
            return True
        return False

    def done(self) -> bool:
        target = self.p.total_steps
        if target is not None and self.steps >= target:
            self.res.finished = True
            self.res.stop_reason = "total steps reached"
            return True
        return self.t >= self.end or self.too_few()

    def result(self) -> PolicyResult:
        r = self.res
        r.wall_s = min(self.t, self.end)
        r.steps, r.committed_mb, r.processed_mb = self.steps, self.committed, self.processed
        r.deaths_s = [d for d in self.deaths if d < r.wall_s]
        r.gpu_hours = self._gpu_h(r.wall_s)
        if not r.stop_reason:
            r.stop_reason = "budget"
        self.record()
        return r


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) in integers; infinite when no replica is left to share the work (b <= 0)."""
    return -(-a // b) if b > 0 else math.inf  # type: ignore[return-value]
