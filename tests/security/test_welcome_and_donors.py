"""The coordinator's parameters reach a member in its sealed welcome; a joiner is admitted only on
its donor's word.

Invariants checked, against a real coordinator and real `Member`s:
- a member's --stale-s, R and shard ports are the coordinator's, as its welcome (sealed by the
  session) says, even when the store holds other values sealed with the run's token (a relay's
  bare welcome is an unsealed line: test_liveness_session.py); tokenless, and from a restarted
  (`recover`) coordinator whose welcome waits for the resume point, the same;
- a joiner's `ready`, said twice by the joiner itself (a token holder that received nothing), does
  not admit it; the donor member's `donated` for that join does.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from faults.conftest import Row
from recover.control import Coordinator, CoordinatorConfig, FenceHandlers, Member, keys, sealed
from recover.control.member import Identity
from recover.settings import FaultTolerance

pytestmark = pytest.mark.timeout(40)
TOKEN = "the welcome's token"
FT = FaultTolerance(join_timeout_s=20.0)
STALE_S = 5.0


@contextlib.contextmanager
def _coordinator(**config: object) -> Iterator[Coordinator]:
    coord = Coordinator(CoordinatorConfig(host="127.0.0.1", port=0, stale_s=STALE_S,
                                          join_timeout_s=20.0, **config))  # type: ignore[arg-type]
    coord.port = coord.start()
    stop = threading.Event()
    th = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    th.start()
    try:
        yield coord
    finally:
        stop.set()
        th.join(10)
        coord.close()


def _member(coord: Coordinator, replica: int, fenced: list[str], token: str | None = TOKEN,
            **identity: int) -> Member:
    return Member("127.0.0.1", coord.port, replica, ft=FT,
                  identity=Identity(token=token, **identity),
                  handlers=FenceHandlers(fenced=fenced.append, partitioned=fenced.append,
                                         stuck=fenced.append))


def _join_all(members: list[Member]) -> None:
    threads = [threading.Thread(target=m.join, daemon=True) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(m.generation() >= 0 for m in members)


def _until(cond, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_parameters_come_from_the_sealed_welcome(record: Row) -> None:
    """The store's `coord/stale_s`, `coord/replicas`, `coord/shards` hold wrong values sealed
    with the run's own token (the worst case: a token holder's, never put back): members take
    the coordinator's from their sealed welcome. (A relay's bare, unsealed `welcome` is ignored
    like every unsealed line: tests/security/test_liveness_session.py.)"""
    record.scenario = ("`coord/stale_s`, `coord/replicas`, `coord/shards` rewritten with values "
                       "sealed by the run's token, never put back (tests/security, in-process)")
    record.expected = ("each member's fence bound, R and shard ports are the coordinator's (its "
                       "sealed welcome's); no member fenced")
    fenced: list[str] = []
    with _coordinator(replicas=2, token=TOKEN) as coord:
        coord._reassert = lambda now: None  # type: ignore[method-assign]  # the worst case
        forged = {keys.COORD_STALE_S: "0.001", keys.REPLICAS: "7", keys.SHARDS: "[1, 2, 3]"}
        for k, v in forged.items():
            coord.client.set(k, sealed.seal(TOKEN, k, v.encode()))
        members = [_member(coord, r, fenced) for r in range(2)]
        _join_all(members)
        got = [(m.fence_after_s, m.replicas, m.shard_ports) for m in members]
        assert got == [(3 * STALE_S, 2, [])] * 2, got
        time.sleep(0.5)  # a bound of 3 ms would have fenced them by now
        assert fenced == [] and coord.members == [0, 1]
        record.measured = f"fence bound {got[0][0]:g}s, R {got[0][1]}, shards {got[0][2]}"
        for m in members:
            m.leave()


def test_a_restarted_tokenless_coordinators_welcome_carries_them() -> None:
    """Tokenless, from a `recover` coordinator (its welcome waits for the resume point) with two
    store shards: the member's parameters are the welcome's, the shard ports included."""
    fenced: list[str] = []
    with _coordinator(replicas=1, recover=True, store_shards=2) as coord:
        coord.client.set(keys.SHARDS, b"[]")  # the store's (unsealed, tokenless) value is wrong
        coord._reassert = lambda now: None  # type: ignore[method-assign]
        m = _member(coord, 0, fenced, token=None, applied=5, last_generation=2)
        _join_all([m])
        assert m.generation() == 3  # numbered after what the rank knew
        assert (m.fence_after_s, m.replicas) == (3 * STALE_S, 1)
        assert m.shard_ports == [int(s.port) for s in coord.shards] and len(m.shard_ports) == 2
        assert fenced == []
        m.leave()


def test_a_phantom_ready_admits_nobody_the_donors_word_does(record: Row) -> None:
    record.scenario = ("a joiner that holds the token but received no state says `ready` twice "
                       "over its own sealed session (tests/security, in-process coordinator)")
    record.expected = ("not admitted (the generation stays); admitted once the donor member says "
                       "`donated` for that join")
    fenced: list[str] = []
    with _coordinator(replicas=2, token=TOKEN) as coord:
        m0, m1 = _member(coord, 0, fenced), _member(coord, 1, fenced)
        _join_all([m0, m1])
        _until(lambda: coord.generation == 0)
        m1.crash()
        _until(lambda: coord.members == [0])
        gen = coord.generation
        phantom = _member(coord, 1, fenced)
        phantom.join()
        assert phantom.joining and phantom.join_epoch > 0
        epoch = phantom.join_epoch
        _until(lambda: m0.join_requests.get(1, (None,))[0] == epoch)
        phantom.report_ready(epoch)
        phantom.report_ready(epoch)
        time.sleep(1.5)  # ample for the coordinator to have admitted it, were `ready` enough
        assert coord.generation == gen and coord.members == [0] and phantom.joining
        m0.report_donated(epoch, 1)
        _until(lambda: coord.members == [0, 1] and not phantom.joining)
        record.measured = (f"generation {gen} kept for 1.5 s after two `ready`; admitted in "
                           f"generation {coord.generation} on `donated`")
        assert fenced == []
        for m in (m0, phantom):
            m.leave()
