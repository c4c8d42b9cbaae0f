"""A multi-rank replica's speaker (recovery/speaker.py, recovery/decide.py): what it shares when
it cannot decide; its link over a real gloo group of two processes (`replica.link`); and what
a rank of a replica that lost a rank raises (`Replica.guard`).

The decision's store is a stub that raises; the link records what the speaker hands its
siblings. (The protocol with real ranks: tests/test_protocol.py, tests/test_control_plane.py with
`speaker=True`; real processes: tests/test_layouts.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import DistNetworkError

from _link_ranks import ENTRY
from harness.processes import session
from harness.runs import free_ports
from recover.control import CoordinatorLost, keys
from recover.recovery import SPEAKER_FAILED, SPEAKER_LOST, InStepRecovery, RecoveryError
from recover.recovery.chain import OwnershipChain
from recover.recovery.decide import CommitDecision
from recover.replica.handle import Replica
from recover.settings import FaultTolerance, Hooks

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


class _EntryLink:
    """A sibling's view: its speaker shares entry 1 (generation 1, every id of step 3 (N = 2)
    to replica 0: read against `step_ids`, recovery/chain.py)."""

    def __init__(self) -> None:
        self.shared: list[bytes | None] = []

    def share(self, value: bytes | None) -> bytes:
        self.shared.append(value)
        return value or json.dumps({"gen": 1, "assign": {"0": [6, 7]}}).encode()


def chain_of(position: int, link: _EntryLink, store: _Store) -> OwnershipChain:
    return OwnershipChain(_Member(), store, None, InStepRecovery(), 2,  # type: ignore[arg-type]
                          position, 2, FaultTolerance(), Hooks(), link)  # type: ignore[arg-type]


def test_a_sibling_reads_the_chain_from_its_speaker_after_agreeing_on_what_it_moves_past() -> None:
    """Position 1 moving from generation 0 to 1: it agrees on 0 first (`moved_past`), then takes
    entry 1 from its speaker; it asks the store nothing."""
    store, link, past = _Store(None), _EntryLink(), []
    entry0 = {"gen": 0, "assign": {"0": [6], "1": [7]}}
    got = chain_of(1, link, store).sync(3, 3, [entry0], 1, [0], past.append)
    assert got == [entry0, {"gen": 1, "assign": {"0": [6, 7]}}]
    assert past == [0] and link.shared == [None] and store.calls == []


@pytest.mark.parametrize("position", [0, 1])
def test_with_a_speaker_a_call_adds_one_entry_whatever_generation_it_sees(position: int) -> None:
    """A position that sees generation 3 while the chain's next entry is of generation 1 (or
    whose entry 0 is implied) stops there: its sibling may see an older generation and compute
    that entry's microbatches, whose intra-replica collectives need this position too; it
    extends again at its next attempt (recovery/chain.py)."""
    store, link, past = _Store(None), _EntryLink(), []
    entry0 = {"gen": 0, "assign": {"0": [6], "1": [7]}}
    if position == 0:  # the speaker's store holds entry 1 of generation 1 already
        store.compare_set = (  # type: ignore[method-assign]
            lambda key, old, new: json.dumps({"gen": 1, "assign": {"0": [6, 7]}}).encode())
    got = chain_of(position, link, store).sync(3, 3, [entry0], 3, [0], past.append)
    assert [e["gen"] for e in got] == [0, 1] and past == [0] and len(link.shared) == 1
    implied = chain_of(position, link, store)
    implied.committed(2, 0, keys.COMMIT)  # step 2 committed: step 3's entry 0 is implied
    first = implied.sync(3, 3, [], 3, [0, 1], past.append)
    assert [e["gen"] for e in first] == [0] and len(link.shared) == 1 and past == [0]


class _LateMember(_Member):
    """A sibling that has learned generation 0 only; generation 2 (members [0]) arrives by the
    coordinator's push while it waits."""

    def __init__(self) -> None:
        self.known = {0: [0, 1]}

    def members(self, g: int) -> list[int]:
        if g not in self.known:
            raise KeyError(g)
        return self.known[g]

    def generation(self) -> int:
        return max(self.known)

    def wait_newer(self, g: int, timeout_s: float) -> int:
        assert timeout_s > 0
        self.known[2] = [0]
        return 2


def test_a_commit_on_evidence_implies_the_next_plan_for_the_generation_it_names() -> None:
    """`commit@2` (decided on evidence counted in generation 2): step 3's entry 0 is implied for
    generation 2's members, on a sibling too that learns generation 2 only after its speaker
    shared the decision (it waits for the push); nothing is read from the store."""
    store, link, past = _Store(None), _EntryLink(), []
    chain = OwnershipChain(_LateMember(), store, None, InStepRecovery(), 2,  # type: ignore[arg-type]
                           1, 2, FaultTolerance(), Hooks(), link)  # type: ignore[arg-type]
    chain.committed(2, 0, keys.commit_at(2))
    first = chain.sync(3, 3, [], 2, [0], past.append)
    assert len(first) == 1 and first[0]["gen"] == 2, first
    assert list(first[0]["assign"]) == ["0"] and len(first[0]["assign"]["0"]) == 2, first
    assert store.calls == [] and link.shared == [] and past == []
    assert keys.is_commit(keys.commit_at(2)) and not keys.is_commit(b"commit@x")
    assert keys.implied_generation(keys.COMMIT_PLAN, 0) is None


@pytest.mark.parametrize(("error", "shared"), [
    (DistNetworkError("Connection reset by peer"), SPEAKER_LOST),  # its redo's store died
    (RecoveryError("no plan"), SPEAKER_FAILED)])
def test_a_speaker_that_cannot_move_past_a_generation_tells_its_siblings(
        error: Exception, shared: bytes) -> None:
    """The speaker's `redo` of the generation it moves past fails: its sibling, already past its
    own agreement and waiting for entry 1, is told how (and raises alike), not left to its
    bound."""
    link = _EntryLink()

    def moved_past(g: int) -> None:
        raise error

    with pytest.raises(type(error)):
        chain_of(0, link, _Store(None)).sync(3, 3, [{"gen": 0, "assign": {}}], 1, [0],
                                            moved_past)
    assert link.shared == [shared]


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


def test_the_link_hands_a_decision_a_chain_entry_and_a_lost_coordinator_to_the_sibling(
        tmp_path: Path) -> None:
    """`IntraReplicaLink` between two real processes (tests/_link_ranks.py): both read the MIN
    agreement, the speaker's decision (a code, one broadcast), its chain entry byte for byte
    (~11 kB: its length, then the bytes), and its lost coordinator raises on both."""
    port = free_ports(1)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = [session().start("_link_ranks:main", [str(tmp_path), str(port), str(r)],
                             tmp_path / f"rank{r}.log", env=env) for r in range(2)]
    try:
        for r, p in enumerate(ranks):
            assert p.wait(25) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    finally:
        for p in ranks:  # by PID (a no-op for those that exited)
            if p.poll() is None:
                p.kill()
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["agree"] is True and got["disagree"] is False, got
        assert got["decision"] == keys.COMMIT.decode() and got["entry"] == ENTRY, got
        assert "rank 0 lost it" in got["lost"], got
