"""A multi-rank replica's speaker: position 0 talks to the store for the whole replica and hands
what it learned to its siblings through the replica's own group (`ReplicaLink`).

Invariant: every position of a replica calls its link at the same points of the step protocol,
in the same order, so each call pairs with its siblings': per chain entry read from the store,
one `share` of the entry (recovery/chain.py), then for its generation one `agree`, followed by
one `share` of the decision when all agreed (recovery/decide.py). What position 0 shares reaches
every position, or every position raises: a speaker that could not learn the value shares why
(`SPEAKER_LOST`: the coordinator or its store is gone; `SPEAKER_FAILED`: anything else), and
`from_speaker` raises the same on its siblings, so none waits for it to its bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

from torch.distributed import DistError

from recover.control import CoordinatorLost
from recover.recovery.failures import RecoveryError


class ReplicaLink(Protocol):
    """A multi-rank replica's own agreement, through its intra-replica group (every position
    calls each method at the same points, in the same order)."""

    def agree(self, g: int, ok: bool) -> bool:
        """Whether every position of this replica is at generation g with `ok` true."""
        ...

    def share(self, value: bytes | None) -> bytes:
        """Position 0's `value` (None elsewhere: a decision or a chain entry), on every
        position, read by `from_speaker` (which raises on every position if position 0 passes
        SPEAKER_FAILED or SPEAKER_LOST)."""
        ...


# What a speaker shares instead of a value when it raised (its siblings then raise too):
SPEAKER_FAILED = b"failed"  # RecoveryError
SPEAKER_LOST = b"lost"  # CoordinatorLost: the coordinator (or its store) is gone: rejoin one


def from_speaker(value: bytes) -> bytes:
    """What a sibling does with what its speaker shared: the value, or the speaker's error
    raised here too (a lost coordinator: the whole replica rejoins a restarted one)."""
    if value == SPEAKER_LOST:
        raise CoordinatorLost("the coordinator is unreachable (this replica's rank 0 lost it while "
                              "it spoke to the store for the replica)")
    if value == SPEAKER_FAILED:
        raise RecoveryError("this replica's rank 0 could not learn what it speaks for (the "
                            "step's plan or decision)")
    return value


def speak(link: ReplicaLink, learn: Callable[[], bytes]) -> bytes:
    """Position 0's side of a `share`: learn the value from the store, then share it. If
    learning raises, the siblings are told how (so they raise alike) before it propagates. The
    store's own errors count as the coordinator's loss (its process serves the store): the
    whole replica then waits for a restarted one, as the app counts them."""
    try:
        value = learn()
    except Exception as e:
        lost = isinstance(e, (CoordinatorLost, DistError))
        with contextlib.suppress(Exception):
            link.share(SPEAKER_LOST if lost else SPEAKER_FAILED)
        raise
    return link.share(value)
