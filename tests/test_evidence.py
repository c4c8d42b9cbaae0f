"""Eviction on evidence: a member that is only late is never evicted; a stalled or isolated one is.

The rule (`admission.convicted`) as a pure function, then the coordinator on real sockets with
members that speak the line protocol by hand: heartbeats (`hb`, or `hb <s>` from a main thread
stalled in the step protocol), `fail <g> <named>` from a barrier, and `arrived <g>` when the
named members caught up. The real-process scenarios (a deadlock, a partition, a SIGKILL across
network hosts) are tests/faults/ and tests/test_multihost.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recover.control import Coordinator, CoordinatorConfig, keys
from recover.control.admission import convicted, cut_off

pytestmark = pytest.mark.timeout(60)
STALE_S = 1.0  # heartbeats every 50 ms: silence is never what these tests see


def test_lateness_alone_convicts_nobody() -> None:
    # One survivor names the other (the CI run that evicted a healthy replica), or two name a
    # third: late members may be slow, not lost.
    assert convicted({2: {0}}, [0, 2]) == []
    assert convicted({3: {0, 2}}, [0, 2, 3]) == []
    # Two slow members: the one that arrived names the other; nobody is convicted.
    assert convicted({1: {0}, 2: {0, 1}}, [0, 1, 2]) == []


def test_stalled_or_isolated_members_are_convicted() -> None:
    # Named, and its own heartbeats say its main thread is stalled in the protocol.
    assert convicted({2: {0}}, [0, 2], stalled={2}) == [2]
    assert convicted({2: {0}}, [0, 2], stalled={0}) == []  # a stalled reporter is not named
    # A partitioned member names everyone and everyone names it; the reporters are not evicted.
    assert convicted({1: {0, 2, 3}, 0: {1}, 2: {1}, 3: {1}}, [0, 1, 2, 3]) == [1]
    # Two members that name each other: nothing is conclusive.
    assert convicted({0: {1}, 1: {0}}, [0, 1]) == []
    # Naming oneself counts for nothing.
    assert convicted({1: {1}}, [0, 1], stalled={1}) == []


class Fake:
    """One rank's liveness connection: a hello, then heartbeats every 50 ms until closed."""

    def __init__(self, port: int, replica: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.stalled = 0.0
        self.lock = threading.Lock()
        self.send(f"hello {replica} 0 1 {1000 + replica}")
        self.stop = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def send(self, line: str) -> None:
        with self.lock:
            self.sock.sendall(line.encode() + b"\n")

    def _beat(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.send(f"hb {self.stalled:.2f}" if self.stalled else "hb")
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[Coordinator, list[Fake]]]:
    coord = Coordinator(CoordinatorConfig(replicas=3, host="127.0.0.1", port=0, stale_s=STALE_S,
                                          join_timeout_s=30.0,
                                          log_path=str(tmp_path / "coordinator.jsonl")))
    coord.start()
    stop = threading.Event()
    th = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    th.start()
    assert coord.liveness_port is not None
    fakes = [Fake(coord.liveness_port, r) for r in range(3)]
    wait_generations(coord, 1)
    yield coord, fakes
    for f in fakes:
        f.close()
    stop.set()
    th.join(10)


def wait_generations(coord: Coordinator, count: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while keys.store_int(coord.client, keys.GEN_COUNT) < count:
        assert time.monotonic() < deadline, f"no generation {count - 1} within {within_s}s"
        time.sleep(0.01)


def members(coord: Coordinator, g: int) -> list[int]:
    return keys.decode_members(coord.client.get(keys.members_key(g)))


def test_a_late_member_that_arrives_is_not_evicted(run: tuple[Coordinator, list[Fake]]) -> None:
    coord, fakes = run
    fakes[0].send("fail 0 2")  # replica 2 missed replica 0's barrier for suspect_s...
    time.sleep(0.2)
    fakes[0].send("arrived 0")  # ...and then arrived: nothing is rebuilt, nobody evicted
    time.sleep(3 * STALE_S)
    assert keys.store_int(coord.client, keys.GEN_COUNT) == 1
    assert not coord.accusations and coord.accused_since is None


def test_late_members_get_a_rebuild_not_an_eviction(run: tuple[Coordinator, list[Fake]]) -> None:
    coord, fakes = run
    fakes[0].send("fail 0 2")
    fakes[1].send("fail 0 2")  # two name it: still only lateness
    wait_generations(coord, 2, within_s=4 * STALE_S + 2)
    assert members(coord, 1) == [0, 1, 2]


def test_a_named_member_whose_main_thread_stalls_is_evicted(
        run: tuple[Coordinator, list[Fake]]) -> None:
    coord, fakes = run
    fakes[0].send("fail 0 2")
    time.sleep(0.3)
    assert keys.store_int(coord.client, keys.GEN_COUNT) == 1
    fakes[2].stalled = 2.5  # its heartbeats now report a stalled main thread
    wait_generations(coord, 2, within_s=2.0)
    assert members(coord, 1) == [0, 1]
    assert "stalled" in coord.client.get(keys.reason_key(1)).decode()


def test_a_member_others_wait_for_in_a_reduce_is_evicted_once_stalled(
        run: tuple[Coordinator, list[Fake]]) -> None:
    """A reduce names nobody: a member waiting in one past suspect_s (`wait`) accuses whoever's
    main thread stalls meanwhile (a deadlock between steps), and nobody for lateness alone."""
    coord, fakes = run
    fakes[0].send("wait 0")
    fakes[1].send("wait 0")
    time.sleep(0.5)
    assert keys.store_int(coord.client, keys.GEN_COUNT) == 1  # nobody stalled: only late
    fakes[0].send("arrived 0")  # replica 0's op ended: its wait accuses nobody any more
    time.sleep(0.2)
    fakes[2].stalled = 2.5
    wait_generations(coord, 2, within_s=2.0)  # replica 1 still waits: 2 is convicted
    assert members(coord, 1) == [0, 1]
    assert "its main thread stalled while replica(s) [1] waited for it" in \
        coord.client.get(keys.reason_key(1)).decode()


def test_a_member_only_slower_at_the_same_work_is_not_evicted(
        run: tuple[Coordinator, list[Fake]]) -> None:
    """The waiter spent 1 s between its steps (an evaluation, say): a member stalled 2.5 s
    there is slower, not stuck; stalled past 3 x 1 s, it is."""
    coord, fakes = run
    fakes[0].send("wait 0 1.000")
    fakes[2].stalled = 2.5
    time.sleep(0.5)
    assert keys.store_int(coord.client, keys.GEN_COUNT) == 1
    fakes[2].stalled = 3.5
    wait_generations(coord, 2, within_s=2.0)
    assert members(coord, 1) == [0, 1]


def test_a_withdrawn_wait_accuses_nobody(run: tuple[Coordinator, list[Fake]]) -> None:
    coord, fakes = run
    fakes[0].send("wait 0")
    fakes[0].send("arrived 0")
    time.sleep(0.2)
    fakes[2].stalled = 2.5  # stalled after every wait ended: nothing waits for it
    time.sleep(1.0)
    assert keys.store_int(coord.client, keys.GEN_COUNT) == 1


def test_an_isolated_member_is_evicted(run: tuple[Coordinator, list[Fake]]) -> None:
    coord, fakes = run
    fakes[1].send("fail 0 0,2")  # replica 1 reaches nobody...
    fakes[0].send("fail 0 1")
    time.sleep(0.2)
    assert keys.store_int(coord.client, keys.GEN_COUNT) == 1  # one accuser: not yet
    fakes[2].send("fail 0 1")  # ...and everyone names it
    wait_generations(coord, 2, within_s=2.0)
    assert members(coord, 1) == [0, 2]
    assert "reaches nobody" in coord.client.get(keys.reason_key(1)).decode()


def test_cut_off_keeps_every_pair_of_the_rest_connected() -> None:
    # Two that only name each other: exactly one goes, the later reporter (or the silent one).
    assert cut_off({0: {1}, 1: {0}}, [0, 1], [0, 1]) == [1]
    assert cut_off({0: {1}, 1: {0}}, [1, 0], [0, 1]) == [0]
    # ... unless one was admitted later (a replacement): it goes, whoever reported first.
    assert cut_off({0: {1}, 1: {0}}, [1, 0], [0, 1], since={0: 0, 1: 5}) == [1]
    assert cut_off({0: {1}, 1: {0}}, [0, 1], [0, 1], since={0: 5, 1: 0}) == [0]
    assert cut_off({0: {1}, 1: {0}}, [1, 0], [0, 1], since={0: 5, 1: 5}) == [0]
    assert cut_off({2: {3}}, [2], [0, 1, 2, 3]) == [3]
    assert cut_off({3: {2}}, [3], [0, 1, 2, 3]) == [2]
    # The side fewer others reach goes first, whoever reported first.
    assert cut_off({3: {1, 2}, 2: {3}}, [3, 2], [0, 1, 2, 3]) == [3]
    # A member that reaches nobody goes; reporters are kept.
    assert cut_off({1: {0, 2, 3}}, [1], [0, 1, 2, 3]) == [1]
    # Two disjoint cuts: one of each pair.
    assert cut_off({0: {1}, 2: {3}}, [0, 2], [0, 1, 2, 3]) == [1, 3]
    # Names outside the members count for nothing; nothing named, nobody evicted.
    assert cut_off({0: {9}}, [0], [0, 1]) == [] and cut_off({}, [], [0, 1]) == []
