"""The shrink-batch baseline (torchft's behaviour) as a step strategy.

Invariant: each replica owns a fixed data shard, its share of every step's N ids under the
original R-way equal split (`plan(step, N, replicas)`); nobody ever computes another replica's
share. A step commits, by the step engine's usual agreement, only if every member of the
generation it was computed in holds the verified sum of exactly those members' shares; if a member
is lost before that, the attempt is discarded (`keeps_work = False`: no optimizer step, nothing
kept) and the survivors compute the step again over their own shares only. The committed gradient
is the mean over the microbatches actually reduced (sum * N / count, since the trainer scales each
microbatch by 1/N), and the step's count is reported as it is, so the batch shrinks honestly.
"""

from __future__ import annotations

from collections.abc import Sequence

from recover.recovery.strategy import Chain, chain_owners
from recover.workload import plan


class ShrinkBatch:
    """A `StepStrategy`: discard the attempt on a loss, continue with the survivors' shares."""

    keeps_work = False

    def __init__(self, replicas: Sequence[int]) -> None:
        self.replicas = sorted(replicas)  # the original membership that fixes every share

    def assign(self, step: int, n: int, chain: Chain, members: list[int],
               speeds: dict[int, float] | None) -> dict[int, list[int]]:
        share = plan(step, n, self.replicas)
        return {m: share.get(m, []) for m in members}

    def owners(self, chain: Chain) -> dict[int, int]:
        return chain_owners(chain[-1:])  # only the newest attempt's shares are in its sum

    def scale(self, count: int, n: int) -> float:
        return n / count
