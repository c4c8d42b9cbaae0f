"""A new generation reaches the members in the coordinator's push, not through the store.

The push carries the generation as a change to the one published before it
(`keys.gen_push`), so a member that knows that one learns the new members without a store
round trip: after a failure, every survivor no longer asks the one store server at the same
moment. A member that does not know the base reads the store, as before. The coordinator and
the members here are the real ones, on real sockets, in this process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recover.control import Coordinator, CoordinatorConfig, FenceHandlers, Member, keys
from recover.settings import FaultTolerance

FT = FaultTolerance(join_timeout_s=30.0)  # the members' store connects and joins

pytestmark = pytest.mark.timeout(60)


def test_the_push_carries_the_change_and_nothing_else() -> None:
    line = keys.gen_push(5, 4, [0, 1, 2, 3], [0, 2, 3, 7])
    assert line == "gen 5 4 1 7\n"
    words = line.split()
    assert keys.read_gen_push(words, {4: [0, 1, 2, 3]}) == (5, [0, 2, 3, 7])
    assert keys.read_gen_push(words, {3: [0, 1, 2, 3]}) == (5, None)  # base unknown: the store
    assert keys.gen_push(1, 0, [0, 1], [0, 1]) == "gen 1 0 - -\n"  # a rebuild, same members
    assert keys.read_gen_push("gen 1 0 - -".split(), {0: [0, 1]}) == (1, [0, 1])
    assert keys.gen_push(0, None, [], [0, 1]) == "gen 0\n"  # the first generation
    assert keys.read_gen_push(["gen", "0"], {}) == (0, None)
    many = list(range(keys.PUSH_DELTA_MAX + 1))
    assert keys.gen_push(3, 2, many, []) == "gen 3\n"  # too large a change is not pushed


class Counting:
    """A store client that records the keys each call was given (and forwards it)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            self.calls.append((name, args[:1]))
            return attr(*args, **kw)
        return call if callable(attr) else attr


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    coord = Coordinator(CoordinatorConfig(replicas=3, host="127.0.0.1", port=0, stale_s=2.0,
                                          join_timeout_s=30.0,
                                          log_path=str(tmp_path / "coordinator.jsonl")))
    port = coord.start()
    stop = threading.Event()
    th = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    th.start()
    coord.port = port
    yield coord
    stop.set()
    th.join(10)


def test_survivors_learn_a_generation_without_reading_the_store(coordinator: Coordinator
                                                                ) -> None:
    fenced: list[str] = []
    members = [Member("127.0.0.1", coordinator.port, r, ft=FT,
                      handlers=FenceHandlers(fenced=fenced.append)) for r in range(3)]
    threads = [threading.Thread(target=m.join, daemon=True) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(m.generation() == 0 for m in members)
    stores = {}
    for m in members[:2]:  # every store client of theirs from now on counts its calls
        stores[m.replica] = [Counting(m._rd_store), Counting(m._hb_store)]
        m._rd_store, m._hb_store = stores[m.replica]
    t0 = time.monotonic()
    members[2].leave()
    for m in members[:2]:
        while m.generation() < 1:
            assert time.monotonic() - t0 < 10, "generation 1 was not learned"
            time.sleep(0.005)
    learned = time.monotonic() - t0
    stored = keys.decode_members(coordinator.client.get(keys.members_key(1)))
    assert stored == [0, 1]
    for m in members[:2]:
        assert m.members(1) == stored
        reader, refresher = stores[m.replica]
        assert reader.calls == [], reader.calls  # the push carried it
        # The 2 s fallback may have run meanwhile: it reads the count, and never generation 1's
        # members, which the push had already given.
        assert (keys.members_key(1),) not in [a for _, a in refresher.calls], refresher.calls
    assert not fenced
    assert learned < 2.0, f"learned {learned:.2f}s after the leave: the fallback, not the push"
    for m in members[:2]:
        m.leave()


def test_a_member_that_missed_the_base_reads_the_store(coordinator: Coordinator) -> None:
    members = [Member("127.0.0.1", coordinator.port, r, ft=FT) for r in range(3)]
    threads = [threading.Thread(target=m.join, daemon=True) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    m = members[0]
    # A push that changes a generation this member never learned: it must not guess.
    assert m._pushed("gen 7 6 1 -".split()) == 7
    assert m.generation() == 0
    # Forget generation 0, the base of the next push: the member must read generation 1 from
    # the store, and still learn exactly the members the coordinator stored.
    with m._lock:
        del m._members[0]
    reader = Counting(m._rd_store)
    m._rd_store = reader
    members[2].leave()
    deadline = time.monotonic() + 10
    while m.generation() < 1:
        assert time.monotonic() < deadline, "generation 1 was not learned"
        time.sleep(0.005)
    assert m.members(1) == [0, 1]
    assert (keys.members_key(1),) in [a for _, a in reader.calls], reader.calls
    for x in members[:2]:
        x.leave()
