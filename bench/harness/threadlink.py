"""A multi-rank replica's own groups for the in-process harness's ranks, which are threads
(harness.inproc): the speaker's `ReplicaLink` and the per-microbatch lockstep that FSDP's
collectives impose on a replica's positions.

Invariant: each call is a barrier round of the replica's positions and returns the same answer
on every one of them; when one of them dies or is fenced the barrier is broken, and a position
waiting in it does what `Replica.guard` does: it reports the replica lost and waits to be fenced
(its thread then parks, as a process exits).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from recover.recovery import from_speaker

if TYPE_CHECKING:
    from harness.inproc import Rank


class ThreadLink:
    """A replica's group of position threads: its `ReplicaLink` (what `replica.link` does over
    a process group, through `PositionLink`) and its microbatches' lockstep (`together`)."""

    def __init__(self, positions: int, timeout_s: float) -> None:
        self.barrier = threading.Barrier(positions, timeout=timeout_s)
        self.slots: list[Any] = [None] * positions

    def agree(self, rank: Rank, g: int, ok: bool) -> bool:
        return all(s == (g, True) for s in self._round(rank, (g, ok)))

    def together(self, rank: Rank, value: Any) -> bool:
        """One intra-replica collective of a microbatch (FSDP's all-gathers pair up so): every
        position passes it with the same `value`, or this returns False."""
        return all(s == value for s in self._round(rank, value))

    def share(self, rank: Rank, value: bytes | None) -> bytes:
        got = self._round(rank, value)[0]  # position 0's
        assert got is not None
        return from_speaker(got)

    def _round(self, rank: Rank, value: Any) -> list[Any]:
        """Every position's `value` of this round."""
        self.slots[rank.rank] = value
        self._wait(rank)
        got = list(self.slots)
        self._wait(rank)  # nobody overwrites a slot before all have read them
        return got

    def _wait(self, rank: Rank) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            assert rank.member is not None
            rank.member.report_lost(f"rank {rank.rank}: a sibling died")
            rank.dead.wait(rank.h.timeout_s)  # until fenced
            rank.dead.block()


class PositionLink:
    """One position's view of its replica's `ThreadLink`."""

    def __init__(self, link: ThreadLink, rank: Rank) -> None:
        self.link, self.rank = link, rank

    def agree(self, g: int, ok: bool) -> bool:
        return self.link.agree(self.rank, g, ok)

    def share(self, value: bytes | None) -> bytes:
        return self.link.share(self.rank, value)
