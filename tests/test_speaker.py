"""A multi-rank replica's speaker (recovery/decide.py): what it shares when it cannot decide;
and what a rank of a replica that lost a rank raises (`Replica.guard`).

The decision's store is a stub that raises; the link records what the speaker hands its
siblings. (The protocol with real ranks: tests/test_protocol.py, tests/test_control_plane.py with
`speaker=True`; real processes: tests/test_layouts.py.)
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import DistNetworkError

from recover.collectives import CoordinatorLost, keys
from recover.parallel.replica import Replica
from recover.recovery import SPEAKER_FAILED, SPEAKER_LOST, RecoveryError
from recover.recovery.decide import CommitDecision

pytestmark = pytest.mark.timeout(30)


class _Member:
    replica, shard_ports = 0, []

    def members(self, g: int) -> list[int]:
        return [0, 1]


class _Store:
    def __init__(self, error: Exception | None) -> None:
        self.error, self.calls = error, []

    def add(self, key: str, n: int) -> int:
        self.calls.append(("add", key, n))
        if self.error is not None:
            raise self.error
        return n

    def compare_set(self, key: str, old: Any, new: Any) -> bytes:
        self.calls.append(("cas", key, new))
        return new if isinstance(new, bytes) else str(new).encode()


class _Link:
    def __init__(self, together: bool) -> None:
        self.together, self.shared = together, []

    def agree(self, g: int, ok: bool) -> bool:
        return ok and self.together

    def share(self, decision: bytes | None) -> bytes:
        self.shared.append(decision)
        return decision or keys.COMMIT


def decision(store: _Store, link: _Link, position: int = 0) -> CommitDecision:
    return CommitDecision(_Member(), store, None, position, 2, 1.0,  # type: ignore[arg-type]
                          lambda step, g: keys.COMMIT, {}, link)


@pytest.mark.parametrize(("error", "shared"), [
    (DistNetworkError("Connection reset by peer"), SPEAKER_LOST),  # the store died with it
    (RecoveryError("no commit decision"), SPEAKER_FAILED)])
def test_a_speaker_that_raises_tells_its_siblings_how(error: Exception, shared: bytes) -> None:
    store, link = _Store(error), _Link(together=True)
    with pytest.raises(type(error)):
        decision(store, link).decide(3, 3, 0, True)
    assert link.shared == [shared]


def test_the_speaker_counts_every_position_and_shares_the_decision() -> None:
    store, link = _Store(None), _Link(together=True)
    # 2 members x 2 positions = 4; this speaker's add of 2 does not complete it: it would wait
    store.add = lambda key, n: (store.calls.append(("add", key, n)), 4)[1]  # type: ignore[method-assign]
    assert decision(store, link).decide(3, 3, 0, True) == keys.COMMIT
    assert store.calls[0] == ("add", keys.count_key(3, 0), 2)
    assert store.calls[1][0] == "cas" and link.shared == [keys.COMMIT]


def test_a_failed_agreement_is_redo_everywhere_written_by_the_speaker() -> None:
    for position in (0, 1):
        store, link = _Store(None), _Link(together=False)
        assert decision(store, link, position).decide(3, 3, 0, True) == keys.REDO
        assert store.calls == ([("cas", keys.decision_key(3, 0), keys.REDO)] if position == 0
                               else [])
        assert link.shared == []  # nothing to share: every position knows it already


class _LostMember:
    replica, reported = 2, []

    def report_lost(self, why: str) -> None:
        self.reported.append(why)

    def generation(self) -> int:
        return 1

    def wait_newer(self, g: int, timeout_s: float) -> int:
        raise CoordinatorLost("the coordinator is unreachable")


def test_a_rank_whose_sibling_died_leaves_with_that_error_even_if_the_coordinator_is_gone() -> None:
    """The sibling's death is what leaves `guard`, not the coordinator's loss met while waiting
    to be fenced: the app would otherwise wait to rejoin a restarted coordinator (60 s in an HSDP
    soak run) with a replica that is lost anyway."""
    me = SimpleNamespace(member=_LostMember(), rank=0)
    with pytest.raises(RuntimeError, match="Connection reset by peer"), Replica.guard(me):
        raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
    assert me.member.reported == [f"rank 0 (pid {os.getpid()}) failed"]
