"""A restarted coordinator (`--recover`): its resume rule, and its protocol on real sockets.

The whole path (workers that keep their state, a SIGKILLed coordinator restarted by `recover
train`, the run resuming on the failure-free trajectory) is in tests/faults/test_coordinator.py;
the state transfer that heals a replica is tests/test_rejoin.py's.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recover.control import Coordinator, CoordinatorConfig, keys
from recover.control.admission import resume_plan

pytestmark = pytest.mark.timeout(60)


def test_resume_plan_rules() -> None:
    # Every replica at the same step: all resume, nobody healed.
    assert resume_plan({0: {0: 5}, 1: {0: 5}}) == (5, [0, 1], [])
    # The commit reached some replicas only: the ones ahead resume, the others are healed.
    assert resume_plan({0: {0: 6}, 1: {0: 5}, 2: {0: 6}}) == (6, [0, 2], [1])
    # A replica whose ranks disagree is healed whole, even if one of its ranks is ahead; the
    # run resumes from the highest step a replica holds on every rank.
    assert resume_plan({0: {0: 6, 1: 5}, 1: {0: 5, 1: 5}}) == (5, [1], [0])
    # A fresh process (-1) holds no state: it is healed, never a source.
    assert resume_plan({0: {0: -1}, 1: {0: 3}}) == (3, [1], [0])
    assert resume_plan({0: {0: -1}}) is None
    assert resume_plan({0: {0: 6, 1: 5}}) is None


class Fake:
    """One rank's liveness connection, speaking the members' line protocol by hand."""

    def __init__(self, port: int, replica: int, rank: int, nranks: int, applied: int,
                 gen: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        self.send(f"hello {replica} {rank} {nranks} {1000 + replica} - - 0 {applied} {gen}")

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode() + b"\n")

    def expect(self, word: str, timeout_s: float = 10.0) -> list[str]:
        """The next line starting with `word` (pings and heartbeats skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                words = line.decode().split()
                if words[:1] == [word]:
                    return words
            left = deadline - time.monotonic()
            assert left > 0, f"no {word!r} line within {timeout_s}s"
            self.sock.settimeout(left)
            self.buf += self.sock.recv(4096)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    coord = Coordinator(CoordinatorConfig(replicas=3, host="127.0.0.1", port=0, stale_s=2.0,
                                          join_timeout_s=30.0, recover=True,
                                          log_path=str(tmp_path / "coordinator.jsonl")))
    coord.start()
    stop = threading.Event()
    th = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    th.start()
    yield coord
    stop.set()
    th.join(10)


def test_restarted_coordinator_resumes_and_heals(coordinator: Coordinator) -> None:
    lport = coordinator.liveness_port
    assert lport is not None
    # Replica 0 (two ranks) applied step 7 on both; replica 1 missed the last commit; replica 2's
    # ranks disagree. The newest generation anyone knew was 3.
    r0 = [Fake(lport, 0, k, 2, 7, 3) for k in range(2)]
    r1 = [Fake(lport, 1, 0, 1, 6, 2)]
    r2 = [Fake(lport, 2, 0, 2, 7, 3), Fake(lport, 2, 1, 2, 6, 3)]
    for f in r0:
        # generations go on after 3; then --stale-s, R and the shards' ports (none)
        assert f.expect("welcome") == ["welcome", "4", "2.0", "3", "-"]
    joining = {}
    for r, fakes in ((1, r1), (2, r2)):
        for f in fakes:
            words = f.expect("joining")
            assert words[3] == "4", words  # the floor: older generations are not in this store
            joining[r] = int(words[1])
    store = coordinator.client
    assert keys.decode_members(store.get(keys.members_key(4))) == [0]
    assert keys.store_int(store, keys.GEN_COUNT) == 5
    assert not store.check([keys.members_key(3)])
    # The members are asked to serve both joiners the state of step 7, the resume point.
    asked = {int(w[1]): (int(w[2]), int(w[3])) for w in (r0[0].expect("join"),
                                                          r0[0].expect("join"))}
    assert asked == {1: (joining[1], 7), 2: (joining[2], 7)}
    # Replica 1's rank holds the transferred state: it is admitted in a new generation.
    r1[0].send(f"ready {joining[1]}")
    r0[0].send(f"donated {joining[1]} 1")  # its donor's word (a `ready` alone admits nobody)
    deadline = time.monotonic() + 10
    while keys.store_int(store, keys.GEN_COUNT) < 6:
        assert time.monotonic() < deadline, "replica 1 was not admitted"
        time.sleep(0.01)
    assert keys.decode_members(store.get(keys.members_key(5))) == [0, 1]
    resumed = [e for e in coordinator_events(coordinator) if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] == 7 and resumed[0]["heal"] == [1, 2], resumed


def coordinator_events(coord: Coordinator) -> list[dict]:
    assert coord.log_path is not None
    return [json.loads(x) for x in Path(coord.log_path).read_text().splitlines()]
