"""Sealed store values and the chain's check against the step's definition, in one process.

Invariant checked: a value a tokenless client writes where the protocol reads (a decision, a
generation's members, a chain entry) is absent to every reader and replaced by the honest
writer (`keys.put_once`), never returned; a chain entry that does not name exactly the step's
ids (`workload.step_ids`) is refused whoever sealed it; a generation's members key holding a
stranger's value does not stop the coordinator's membership from publishing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from recover.control import CoordinatorConfig, keys, sealed
from recover.control.admission import Hello, proof
from recover.control.membership import Membership
from recover.recovery.chain import entry_problem
from recover.recovery.lifetime import Committed, protocol_keys
from recover.recovery.strategy import InStepRecovery
from recover.workload import plan, step_ids

pytestmark = pytest.mark.timeout(30)
TOKEN = "the run's token"
N = 8


@pytest.fixture
def store() -> Iterator[object]:
    server = keys.serve_store("127.0.0.1", 0)
    client = keys.connect_store("127.0.0.1", server.port, 10)
    yield client
    del client, server


def test_a_stranger_value_is_absent_and_replaced(store) -> None:
    key = keys.decision_key(3, 0)
    store.set(key, keys.COMMIT_PLAN)  # a stranger's, written ahead
    assert keys.read(store, TOKEN, key, keys.is_decision) is None
    # The honest writer wins over it, and every reader now reads the honest value.
    assert keys.put_once(store, TOKEN, key, keys.COMMIT, keys.is_decision) == keys.COMMIT
    assert keys.read(store, TOKEN, key, keys.is_decision) == keys.COMMIT
    # Once an authentic value is there, it is the one returned to a later writer (write once).
    assert keys.put_once(store, TOKEN, key, keys.REDO, keys.is_decision) == keys.COMMIT
    # A sealed value moved to another key, or sealed with another token, does not open.
    store.set(keys.decision_key(4, 0), store.get(key))
    assert keys.read(store, TOKEN, keys.decision_key(4, 0)) is None
    assert keys.read(store, "another run", key) is None


def test_without_a_token_only_invalid_values_are_told_apart(store) -> None:
    key = keys.decision_key(5, 0)
    store.set(key, "not a decision")
    assert keys.put_once(store, None, key, keys.REDO, keys.is_decision) == keys.REDO
    assert store.get(key) == keys.REDO  # stored bare: a tokenless run's format is unchanged


def test_open_value_never_raises_on_junk() -> None:
    for raw in (b"", b"|", b"x|" + b"0" * 32, b"\xff" * 100, b"commit|zz"):
        assert sealed.open_value(TOKEN, "k", raw) is None
    assert sealed.open_value(TOKEN, "k", sealed.seal(TOKEN, "k", b"v|w")) == b"v|w"


def test_an_oversized_value_is_refused_unopened_and_replaced(store) -> None:
    """A stranger's value over `sealed.MAX_VALUE` (5 MiB, a real store) is absent to a reader
    with or without a token (never parsed), the honest writer replaces it, and recover never
    seals one that large. What torch's store server holds meanwhile is not recover's to bound
    (DESIGN.md, "Trust")."""
    big = b"[" + b"0," * (sealed.MAX_VALUE // 2 + (1 << 19)) + b"0]"
    assert sealed.MAX_VALUE + 64 < len(big) < 8 << 20  # under torch's own cap on a value
    for token, key in ((TOKEN, keys.decision_key(7, 0)), (None, keys.decision_key(8, 0))):
        store.set(key, big)
        assert keys.read(store, token, key) is None
        assert keys.put_once(store, token, key, keys.COMMIT, keys.is_decision) == keys.COMMIT
    with pytest.raises(ValueError, match="over"):
        sealed.seal(TOKEN, "k", b"x" * (sealed.MAX_VALUE + 1))


def _entry(assign: dict[int, list[int]], **more: object) -> dict:
    return {"gen": 0, "assign": {str(r): ids for r, ids in assign.items()}, **more}


def test_chain_entries_are_checked_against_the_steps_ids() -> None:
    step, replicas = 4, 2
    honest = _entry(plan(step, N, [0, 1]))
    assert entry_problem(honest, step, N, [], replicas, True) is None
    forged = [
        _entry(plan(0, N, [0, 1])),  # step 0's microbatches (issue #50's attack)
        _entry({0: step_ids(step, N)[:-1]}),  # fewer
        _entry({0: step_ids(step, N), 1: [step * N]}),  # one twice
        _entry({0: [*step_ids(step, N), (step + 1) * N]}),  # one of the next step's
        _entry({0: [step * N] * N}),  # the same id N times
        _entry({7: step_ids(step, N)}),  # not a replica of the run
        _entry({0: [str(i) for i in step_ids(step, N)]}),  # not ids
        {"gen": -1, "assign": {"0": step_ids(step, N)}}, {"assign": {}}, [], "x", None,
    ]
    for e in forged:
        assert entry_problem(e, step, N, [], replicas, True) is not None, e
    # After a loss: an entry hands out ids of the step, and leaves each owned exactly once.
    chain = [honest]
    lost = InStepRecovery().assign(step, N, chain, [0], None)
    assert entry_problem(_entry(lost), step, N, chain, replicas, True) is None
    assert entry_problem(_entry({0: [step * N]}), step, N, chain, replicas, True) is None
    assert entry_problem(_entry({0: [0]}), step, N, chain, replicas, True) is not None
    # A join admission: entry 0 only, assigning nothing; the entry after it assigns every id.
    join = {"gen": 0, "assign": {}, "join": {"replica": 1, "epoch": 1, "donor": 0}}
    assert entry_problem(join, step, N, [], replicas, True) is None
    assert entry_problem(join, step, N, chain, replicas, True) is not None
    assert entry_problem(_entry({0: step_ids(step, N)[:4]}), step, N, [join], replicas,
                         True) is not None
    assert entry_problem(honest, step, N, [join], replicas, True) is None


def test_a_forged_generation_does_not_stop_the_coordinator(store) -> None:
    """`[7777]` written ahead at the next generation's members key (issue #50: it made
    `Membership._publish` raise out of `Coordinator.serve`, three restarts in a row)."""
    m = Membership(CoordinatorConfig(replicas=2, port=0, token=TOKEN), store, _Wire(),
                   started=0.0)
    for g in range(3):
        store.set(keys.members_key(g), "[7777]")
    for r in range(2):
        assert m.hello(r, Hello(r, 0, 1, 100 + r, token=proof(TOKEN)))
    assert m.first_generation(now=0.1) and m.generation == 0
    assert keys.generation_members(store, 0, TOKEN) == [0, 1]
    m.lost[1] = "test"
    m.publish_next()
    assert m.generation == 1 and keys.generation_members(store, 1, TOKEN) == [0]
    assert json.loads(keys.read(store, TOKEN, keys.members_key(1)) or b"0") == [0]


class _Wire:
    def send(self, conn: int, msg: str) -> None:
        pass

    def send_all(self, msg: str) -> None:
        pass


def test_counters_are_named_by_the_token() -> None:
    """A counter cannot carry a MAC: with a token its name carries one (`sealed.hidden`), the
    same for every rank and the deleter, and unknown to a process without the token."""
    hidden = keys.count_key(3, 0, TOKEN)
    assert hidden.startswith(keys.count_key(3, 0) + "/") and hidden != keys.count_key(3, 0)
    assert hidden != keys.count_key(3, 0, "another run") != keys.count_key(4, 0, TOKEN)
    assert keys.evidence_key(3, 0, 1, TOKEN) != keys.evidence_key(3, 0, 1)
    old = Committed(3, [{"gen": 0, "assign": {"0": step_ids(3, N)}}], False, 0, [0], 1)
    assert {hidden, keys.evidence_key(3, 0, 1, TOKEN)} <= set(protocol_keys(old, 1, token=TOKEN))
