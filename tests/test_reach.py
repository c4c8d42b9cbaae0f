"""`control.reach`: whom a rank's data path cannot reach, on real sockets of this host.

Only a handshake that fails as a cut fails names a peer: a refused one (its process is gone,
which liveness reports) does not, nor a peer at an address where another peer answered. The cut
itself between two hosts is tests/test_multihost.py's (network namespaces)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from harness.runs import free_ports
from recover.control import reach

pytestmark = pytest.mark.timeout(30)
UNROUTABLE = "192.0.2.1"  # TEST-NET-1: no route from a loopback source (refused by the route)


@pytest.fixture
def listener() -> Iterator[reach.Listener]:
    lis = reach.Listener("127.0.0.1")
    yield lis
    lis.close()


def closed_port() -> int:
    return free_ports(1)  # below the ephemeral range: no other socket is handed it


def test_only_a_path_that_fails_as_a_cut_names_its_peer(listener: reach.Listener) -> None:
    peers = {0: ("127.0.0.1", listener.port), 1: ("127.0.0.1", closed_port()),
             2: (UNROUTABLE, 9)}
    t0 = time.monotonic()
    assert reach.unreachable("127.0.0.1", peers, timeout_s=5.0) == [2]
    assert time.monotonic() - t0 < 5.0  # nobody waited for the bound: every answer was prompt


def test_a_listener_answers_again_and_again(listener: reach.Listener) -> None:
    peers = {r: ("127.0.0.1", listener.port) for r in range(3)}
    for _ in range(20):
        assert reach.unreachable("127.0.0.1", peers, timeout_s=5.0) == []


def test_a_peer_whose_host_answered_for_another_is_not_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reach, "handshakes", lambda source, peers, timeout_s: {1, 2})
    peers = {0: ("10.0.0.5", 1), 1: ("10.0.0.5", 2), 2: ("10.0.0.6", 3)}
    assert reach.unreachable("10.0.0.4", peers, timeout_s=1.0) == [2]


def test_a_watch_probes_once_past_suspect_s_and_reports_once(listener: reach.Listener) -> None:
    reports: list[list[int]] = []
    started: list[bool] = []

    def start() -> reach.Probe:
        started.append(True)
        return reach.Probe("127.0.0.1", {0: ("127.0.0.1", listener.port), 5: (UNROUTABLE, 9)},
                           timeout_s=5.0)

    watch = reach.PathWatch(start, reports.append, suspect_s=1.0)
    watch.turn(0.5)
    assert not started  # a wait shorter than suspect_s is not suspicious
    watch.settle(lambda: False, poll_s=0.01)  # the op failed: probe now, wait for it
    watch.turn(3.0)
    watch.settle(lambda: False, poll_s=0.01)
    assert started == [True] and reports == [[5]]


def test_a_failure_something_else_answers_is_not_probed(listener: reach.Listener) -> None:
    """A crash is the coordinator's to see: when a newer generation answers the failure, the
    watch probes nobody (a probe is a handshake with every member, at every crash otherwise)."""
    started: list[bool] = []

    def start() -> reach.Probe:
        started.append(True)
        return reach.Probe("127.0.0.1", {5: (UNROUTABLE, 9)}, timeout_s=5.0)

    reports: list[list[int]] = []
    answered = reach.PathWatch(start, reports.append, suspect_s=1.0)
    answered.settle(lambda: True, poll_s=0.01, answered=lambda: True)
    assert not started and not reports
    unanswered = reach.PathWatch(start, reports.append, suspect_s=1.0)
    unanswered.settle(lambda: False, poll_s=0.01, answered=lambda: False)  # a cut: probe it
    assert started == [True] and reports == [[5]]
