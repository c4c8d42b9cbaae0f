"""The shrink-batch baseline (torchft's behaviour) as a step-engine variant.

Invariant: each replica owns a fixed data shard, its share of every step's N ids under the
original R-way split (`plan(step, N, range(R))`, equal quotas); nobody ever computes another
replica's share. A step commits, by the same store agreement as `StepEngine`, only if every member
of the generation it was computed in holds the verified sum of the shares of exactly those members;
if a member is lost before that, the attempt is discarded (no optimizer step, nothing kept) and the
survivors compute the step again from scratch over their own shares only. The committed gradient is
the mean over the microbatches actually reduced (sum * N / count, since the worker scales each
microbatch by 1/N), and `StepResult.microbatches` is that count, so the batch shrinks honestly.
`StepEngine` itself (the `recover` policy) is not changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from recover.collectives import ReplicaFault
from recover.recovery import BelowMinReplicas, RecoveryError, StepEngine, StepResult
from recover.recovery.step import MAX_ATTEMPTS, TRAILER
from recover.workload import id_checksum, plan


class ShrinkEngine(StepEngine):
    """`StepEngine` with torchft's reaction to a loss: discard the step, shrink the batch."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.grad is None or getattr(self, "positions", 1) != 1:
            raise ValueError("the shrink-batch baseline supports the plain layout only")

    def shares(self, step: int) -> dict[int, list[int]]:
        """Every replica's own ids of `step` under the original R-way equal split."""
        return plan(step, self.n, self.member.members(0))

    def run(self, step: int, compute: Callable[[int, int], float]) -> StepResult:
        share = self.shares(step)
        mine = share.get(self.me, [])
        t_fault: float | None = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            g = self.member.generation()
            members = self.member.members(g)
            if len(members) < self.min_replicas:
                raise BelowMinReplicas(f"{len(members)} live replica(s) {members} < "
                                       f"--min-replicas {self.min_replicas}")
            self.grad.zero_()  # a discarded attempt leaves nothing behind
            loss_sum = 0.0
            for j, i in enumerate(mine):
                loss_sum += compute(i, j)
            if self.member.generation() != g:  # a member was lost while we computed: discard
                t_fault = t_fault or time.monotonic()
                continue
            expect = sorted(i for m in members for i in share.get(m, []))
            out, ok = self._reduce_shares(step, g, mine, loss_sum, expect)
            self.hook("commit", step, len(mine))
            self.store.set(self._key(step, g, f"out/{self.me}"), b"ok" if ok else b"fail")
            if self._decide(step, g) == b"commit":
                count = int(round(float(out[-TRAILER])))
                self.grad.copy_(out[:-TRAILER] * (self.n / count))
                return StepResult(step, g, members, {m: len(share.get(m, [])) for m in members},
                                  float(out[-1]) / count, count, [],
                                  time.monotonic() - t_fault if t_fault else 0.0, attempt, mine)
            t_fault = t_fault or time.monotonic()
            if self.member.generation() == g:
                self.member.wait_newer(g, self.timeout_s)
        raise RecoveryError(f"step {step} did not commit after {MAX_ATTEMPTS} attempts")

    def _reduce_shares(self, step: int, g: int, held: list[int], loss_sum: float,
                       expect_ids: list[int]) -> tuple[torch.Tensor, bool]:
        """Reduce this replica's share; verify the sum holds exactly the members' shares."""
        trailer = torch.tensor([len(held), id_checksum(held), step % 4096 + 1, loss_sum],
                               dtype=self.grad.dtype)
        buf = torch.cat([self.grad, trailer])
        try:
            out = self.comm.reduce(buf, g, on_issued=lambda: self.hook("reduce", step, len(held)))
        except ReplicaFault:
            return buf, False
        size = len(self.member.members(g))
        expect = (len(expect_ids), id_checksum(expect_ids), (step % 4096 + 1) * size)
        got = tuple(int(round(float(x))) for x in out[-TRAILER:-1])
        if got != expect:
            self.member.report_fail(g)
            return out, False
        return out, True
