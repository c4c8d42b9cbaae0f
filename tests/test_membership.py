"""`control.membership.Membership`'s decisions, driven by calls, with no socket: a dict store
and a list of sent lines stand in for the coordinator's store and connections."""

from __future__ import annotations

import json

import pytest

from recover.control import CoordinatorConfig, keys
from recover.control.admission import Hello
from recover.control.membership import DEBOUNCE_S, Membership, Peer

pytestmark = pytest.mark.timeout(30)


class DictStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def compare_set(self, key: str, expected: str, value: bytes) -> bytes:
        if self.data.get(key, b"") == expected.encode():
            self.data[key] = value
        return self.data[key]

    def add(self, key: str, n: int) -> int:
        v = int(self.data.get(key, b"0")) + n
        self.data[key] = str(v).encode()
        return v

    def multi_set(self, names: list[str], values: list[str | bytes]) -> None:
        for k, v in zip(names, values, strict=True):
            self.set(k, v)


class Lines:
    def __init__(self) -> None:
        self.sent: list[tuple[int | None, str]] = []  # (conn, line); None: to every connection

    def send(self, conn: int, msg: str) -> None:
        self.sent.append((conn, msg))

    def send_all(self, msg: str) -> None:
        self.sent.append((None, msg))

    def to(self, conn: int) -> list[str]:
        return [m for c, m in self.sent if c in (conn, None)]


def started(replicas: int = 3, **config: object) -> tuple[Membership, DictStore, Lines]:
    """A membership whose `replicas` replicas (conn r = replica r) said hello: generation 0."""
    store, wire = DictStore(), Lines()
    m = Membership(CoordinatorConfig(replicas=replicas, port=0, **config), store, wire,
                   started=0.0)
    for r in range(replicas):
        assert m.hello(r, Hello(r, 0, 1, 100 + r))
    assert m.first_generation(now=0.1)
    return m, store, wire


def members(store: DictStore, g: int) -> list[int]:
    return keys.decode_members(store.data[keys.members_key(g)])


def test_the_first_generation_waits_for_every_replica() -> None:
    m = Membership(CoordinatorConfig(replicas=2, port=0), DictStore(), Lines(), started=0.0)
    assert m.hello(0, Hello(0, 0, 1, 10))
    assert not m.first_generation(now=1.0) and m.generation == -1
    assert m.hello(1, Hello(1, 0, 1, 11))
    assert m.first_generation(now=1.0) and m.generation == 0 and m.members == [0, 1]


def test_a_wrong_token_is_refused_and_changes_nothing() -> None:
    store, wire = DictStore(), Lines()
    m = Membership(CoordinatorConfig(replicas=2, port=0, token="s3cret"), store, wire)
    assert not m.hello(7, Hello(0, 0, 1, 10, token="other"))
    assert wire.to(7)[0].startswith("refused wrong run token")
    assert m.peers == {} and m.replicas == {}


def test_a_closed_connection_is_evidence_published_after_the_debounce() -> None:
    m, store, wire = started()
    m.closed(1)
    assert m.exits[1].startswith("lost: connection closed") and m.pending_since is not None
    assert not m.publish_due(m.pending_since)
    assert m.publish_due(m.pending_since + 1.5 * DEBOUNCE_S)
    m.publish_next()
    assert m.generation == 1 and members(store, 1) == [0, 2]
    assert wire.sent[-1] == (None, keys.gen_push(1, 0, [0, 1, 2], [0, 2]))
    assert json.loads(store.data[keys.COORD_EXITS])["1"].startswith("lost")


def test_naming_alone_convicts_nobody_but_a_stalled_named_member_is_evicted() -> None:
    m, _, _ = started()
    m.failed(0, 0, [2])  # replica 0 could not reach replica 2 at its barrier
    assert m.accusations == {2: {0}} and m.pending_since is None  # late is not lost
    m.heartbeat(2, stalled_s=2.5)  # ...and replica 2's main thread says it is stalled
    assert 2 in m.lost and m.pending_since is not None


def test_each_rank_withdraws_only_its_own_wait() -> None:
    """Two ranks of replica 0 wait in their positions' reduces; one's op ends: the other's wait
    still names replica 2 once its main thread stalls past 3 x the waiter's span."""
    store, wire = DictStore(), Lines()
    m = Membership(CoordinatorConfig(replicas=3, port=0), store, wire, started=0.0)
    for conn, (r, rank, n) in enumerate([(0, 0, 2), (0, 1, 2), (1, 0, 1), (2, 0, 1)]):
        assert m.hello(conn, Hello(r, rank, n, 100 + conn))
    assert m.first_generation(now=0.1)
    m.waiting(0, 0, between_s=0.5)
    m.waiting(1, 0, between_s=0.5)
    m.arrived(0, 0)  # rank 0's op ended
    m.heartbeat(3, stalled_s=1.0)  # stalled, but not 3 x 0.5 s
    assert 2 not in m.lost
    m.heartbeat(3, stalled_s=1.6)
    assert 2 in m.lost and "waited for it" in m.lost[2]
    m.closed(1)  # a closed connection's wait goes with it
    assert 1 not in m.waiters


def test_a_withdrawn_naming_stands_no_more() -> None:
    m, _, _ = started()
    m.failed(0, 0, [2])
    m.arrived(0, 0)
    assert m.accusations == {} and m.accused_since is None


def test_a_joiner_is_admitted_only_once_every_rank_is_ready() -> None:
    m, store, wire = started(replicas=3)
    m.closed(2)
    m.publish_next()  # generation 1: [0, 1]
    assert m.hello(12, Hello(2, 0, 2, 200, join_at=5))  # a two-rank replacement for replica 2
    assert m.joins[2].epoch == -1  # not every rank is here yet
    assert m.hello(13, Hello(2, 1, 2, 201, join_at=5))
    epoch = m.joins[2].epoch
    assert epoch == 1 and f"join 2 {epoch} 5\n" in wire.to(0)
    m.ready(12, epoch)
    m.donated(0, epoch, 2)  # replica 0's rank 0 streamed it rank 0's state
    assert m.generation == 1  # one rank's state is not the replica's
    m.ready(13, epoch)
    assert m.generation == 1  # rank 1's state has no donor's word yet
    m.peers[20] = Peer(1, 1, 2, 301)  # the donor's rank 1 (these members have one rank)
    m.donated(20, epoch, 2)
    assert m.generation == 2 and members(store, 2) == [0, 1, 2] and m.exits[2] == "running"
    assert f"joinend {epoch}\n" in wire.to(0)



def test_a_join_given_up_ends_before_its_generation_is_pushed() -> None:
    """A member must have dropped a given-up join when it learns the generation that gives it
    up: else it admits the dead join at the next boundary, in that generation, and waits for a
    newer one that nothing makes (a CI run of the forged-donor test stalled 120 s so)."""
    m, store, wire = started(replicas=3)
    m.closed(2)
    m.publish_next()  # generation 1: [0, 1]
    assert m.hello(12, Hello(2, 0, 1, 200))
    epoch = m.joins[2].epoch
    m.donor_gone(12, epoch)
    assert m.generation == 2 and members(store, 2) == [0, 1]
    to0 = wire.to(0)
    end, gen = to0.index(f"joinend {epoch}\n"), to0.index(keys.gen_push(2, 1, [0, 1], [0, 1]))
    assert end < gen
    assert f"join 2 {m.joins[2].epoch} 0\n" in to0[gen:]  # another donor, another epoch


def test_a_joiner_still_waiting_when_every_member_left_is_told_the_run_is_over() -> None:
    """A replacement that registered near the end waited for its join timeout (or the
    launcher's kill) after the run had finished: the soak's slowest runs."""
    m, _, wire = started(replicas=2)
    m.closed(1)
    m.publish_next()  # generation 1: [0]
    assert m.hello(11, Hello(1, 0, 1, 300, join_at=13))  # replica 1's replacement waits
    for conn in (0,):
        m.bye(conn)
        m.closed(conn)
    m.publish_next()  # generation 2: nobody
    assert m.everyone_left()
    assert "over\n" in wire.to(11)
    assert not m.everyone_left()  # said once
    # One whose hello comes after that is told at once too (the soak's 39-45 s runs: it was
    # announced a join nobody would serve, and killed by the launcher 30 s later).
    m.closed(11)  # it left
    assert m.hello(12, Hello(1, 0, 1, 301, join_at=13))
    assert [line for c, line in wire.sent if c == 12] == ["over\n"]  # no join announced

def test_ready_alone_admits_nobody_only_a_members_donated_does() -> None:
    """A joiner's `ready` (a phantom's, or a replay by a token holder) is not enough: only a
    member's `donated` for that join's epoch and replica completes the admission; the joiner's
    own word, a stale epoch's or another replica's does not."""
    m, store, wire = started(replicas=3)
    m.closed(2)
    m.publish_next()  # generation 1: [0, 1]
    assert m.hello(12, Hello(2, 0, 1, 200))
    epoch = m.joins[2].epoch
    m.ready(12, epoch)
    m.ready(12, epoch)
    m.donated(12, epoch, 2)  # the joiner vouching for itself
    m.donated(0, epoch - 1, 2)  # an older join's
    m.donated(1, epoch, 0)  # a member's word about a replica that is no joiner
    assert m.generation == 1 and 2 in m.joins
    m.donated(1, epoch, 2)
    assert m.generation == 2 and members(store, 2) == [0, 1, 2]
    joining = [x for x in wire.to(12) if x.startswith("joining")]
    assert joining == [f"joining {epoch} 1 0 {m.stale_s!r} 3 -\n"], joining


def test_a_restarted_coordinator_resumes_from_the_highest_whole_step() -> None:
    store, wire = DictStore(), Lines()
    m = Membership(CoordinatorConfig(replicas=2, port=0, recover=True), store, wire,
                   started=0.0)
    assert m.hello(0, Hello(0, 0, 1, 10, applied=7, generation=4))
    assert m.hello(1, Hello(1, 0, 1, 11, applied=6, generation=4))
    assert wire.sent == []  # answered once the resume point is decided
    assert m.first_generation(now=0.1)
    assert m.generation == 5 and members(store, 5) == [0]  # numbered after what ranks knew
    # The welcome carries what a member needs of this coordinator (not read from the store).
    assert f"welcome 5 {m.stale_s!r} 2 -\n" in wire.to(0)
    assert m.joins[1].at == 7 and m.exits[1] == "joining"  # healed by a state transfer


# -- a cut of the data path (`cut <g> <names>`: a member's handshake to another failed) --------
def evicted_by_cut(replicas: int, reports: list[tuple[int, list[int]]]) -> tuple[Membership,
                                                                                  DictStore]:
    """Feed the cut reports in order (within their window), then publish what they decided."""
    m, store, _ = started(replicas)
    for reporter, names in reports:
        m.cut(reporter, 0, names)
    assert m.cut_since is not None
    m.check_timeouts(m.cut_since + m.stale_s / 2)  # the window, not a rebuild's 2 x stale_s
    assert m.pending_since is not None
    m.publish_next()
    return m, store


@pytest.mark.parametrize("first", [0, 1])
def test_two_replicas_that_name_each_other_keep_the_first_reporter(first: int) -> None:
    other = 1 - first
    m, store = evicted_by_cut(2, [(first, [other]), (other, [first])])
    assert members(store, 1) == [first]
    assert m.exits[other] == (f"fenced: unreachable from replica {first} over the data path "
                              f"(a cut; replica {first} reported first)")
    assert m.exits[first] == "running"


@pytest.mark.parametrize("first", [0, 1])
def test_a_replacement_that_cannot_reach_the_incumbent_goes_whoever_reported_first(
        first: int) -> None:
    """Replica 1 is lost, its replacement admitted (generation 2), then it and replica 0 name each
    other (a soak run: the replacement was still cut off): the one admitted later goes, even
    when it reported first; the incumbent stays."""
    m, store, _ = started(2, stale_s=1.0)
    m.closed(1)
    m.publish_next()  # generation 1: [0]
    assert m.hello(11, Hello(1, 0, 1, 201, join_at=3))
    m.ready(11, m.joins[1].epoch)
    m.donated(0, m.joins[1].epoch, 1)
    assert m.generation == 2 and members(store, 2) == [0, 1]
    for reporter in (first, 1 - first):
        m.cut(11 if reporter == 1 else 0, 2, [1 - reporter])
    assert m.cut_since is not None
    m.check_timeouts(m.cut_since + m.stale_s / 2)
    m.publish_next()
    assert members(store, 3) == [0]
    assert m.exits[1] == ("fenced: unreachable from replica 0 over the data path (a cut; it was "
                          "admitted later)")


def test_a_cut_is_decided_once_its_window_passed_and_never_undone() -> None:
    m, _, _ = started(2, stale_s=1.0)
    m.cut(1, 0, [0])
    assert m.cut_since is not None
    m.check_timeouts(m.cut_since + 0.4)  # the other side's probe may still come
    assert m.lost == {}
    m.check_timeouts(m.cut_since + 0.5)
    assert m.lost.keys() == {0} and m.pending_since is not None
    m.cut(0, 0, [1])  # the evicted side's word, too late, changes nothing: never both evicted
    assert m.lost.keys() == {0}


@pytest.mark.parametrize("order", [[2, 3], [3, 2]])
def test_four_replicas_two_of_which_name_each_other_lose_one(order: list[int]) -> None:
    first, second = order
    m, store = evicted_by_cut(4, [(first, [second]), (second, [first])])
    assert members(store, 1) == sorted({0, 1, 2, 3} - {second})
    assert m.exits[second].startswith(f"fenced: unreachable from replica {first} ")


def test_the_side_more_replicas_reach_stays_whoever_reported_first() -> None:
    # Replica 3 cannot reach 2 nor 1; 2 and 1 reach each other and 0: 3 goes, though it spoke
    # first and 2 named it first.
    m, store = evicted_by_cut(4, [(3, [2]), (2, [3]), (1, [3])])
    assert members(store, 1) == [0, 1, 2]
    assert "unreachable from replicas 1, 2 " in m.exits[3]
    assert "the others reach each other without it" in m.exits[3]


def test_a_replica_that_reaches_nobody_is_evicted_on_its_own_report() -> None:
    _, store = evicted_by_cut(4, [(1, [0, 2, 3])])
    assert members(store, 1) == [0, 2, 3]


def test_a_stale_or_empty_cut_report_changes_nothing() -> None:
    m, _, _ = started(3)
    m.cut(0, 7, [1])  # another generation's
    m.cut(0, 0, [0])  # only itself
    m.cut(0, 0, [9])  # no such member
    assert m.lost == {} and m.pending_since is None and m.cuts == {}


def test_a_replacement_before_its_predecessors_loss_is_published_joins() -> None:
    """Replica 1's connection closes; its replacement says hello before the debounce published
    the generation without it: it is a joiner (announced with that generation), not the member
    being dropped (welcomed as that member, it was fenced at once and the join never came)."""
    m, store, wire = started(3)
    m.closed(1)
    assert m.hello(11, Hello(1, 0, 1, 201, join_at=6))
    assert not [x for x in wire.to(11) if x.startswith(("welcome", "joining"))], wire.to(11)
    m.publish_next()
    assert members(store, 1) == [0, 2]
    join = m.joins[1]
    assert join.epoch >= 0 and join.at == 6
    assert wire.to(11)[-1] == f"joining {join.epoch} 1 0 {m.params()}\n", wire.to(11)
    assert f"join 1 {join.epoch} 6\n" in wire.to(0)


def test_the_tree_top_decides_once_every_shard_told_it_and_a_redo_wins() -> None:
    """`shards.TreeTop`, the coordinator's side of the store shards' count tree: it decides on
    the main store only when every shard with ranks of the generation has told it, copies what
    is there into those shards (a `redo` written first wins), and a leader that saw a reason to
    store the next plan makes it `commit-plan`."""
    from recover.control import shards

    main, s0, s1, s2 = DictStore(), DictStore(), DictStore(), DictStore()
    top = shards.TreeTop(main, [s0, s1, s2])
    assert top.counted(["5", "0", "2", "0,2", "commit-plan"]) is None
    assert keys.decision_key(5, 0) not in main.data  # shard 0 has not told it yet
    assert top.counted(["5", "0", "0", "0,2", "commit"]) == keys.COMMIT_PLAN
    for store in (main, s0, s2):
        assert store.data[keys.decision_key(5, 0)] == keys.COMMIT_PLAN
    assert keys.decision_key(5, 0) not in s1.data  # no rank of generation 0 counts there
    main.compare_set(keys.decision_key(6, 1), "", keys.REDO)  # a failed reduce, first
    top.counted(["6", "1", "0", "all", "commit"])
    top.counted(["6", "1", "1", "all", "commit"])
    assert top.counted(["6", "1", "2", "all", "commit"]) == keys.REDO
    assert s1.data[keys.decision_key(6, 1)] == keys.REDO
    for bad in (["6", "1", "3", "all", "commit"], ["6", "1", "0", "all", "redo"],
                ["x/y", "1", "0", "all", "commit"], ["6", "1", "1", "0,2", "commit"]):
        with pytest.raises(ValueError):
            top.counted(bad)
