"""The partition watchdog of `Member`, without processes: a member whose liveness socket is one
end of a socketpair fences itself after its silence bound, also with unread bytes waiting and with
a descriptor past 1024 (where select() raised and the watchdog stopped without fencing)."""

from __future__ import annotations

import fcntl
import resource
import socket
import threading
import time

import pytest

from recover.control import FenceHandlers, Member, keys


@pytest.fixture
def store() -> object:
    return keys.serve_store("127.0.0.1", 0)


def _wait(fired: list[float], deadline: float) -> None:
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)


def _watched_member(store: object, bound_s: float) -> tuple[object, socket.socket, list[float]]:
    """A Member whose liveness socket is one end of a socketpair; returns (member, the
    coordinator's end, the times its watchdog declared it partitioned)."""
    port = store.port  # type: ignore[attr-defined]
    fired: list[float] = []
    m = Member("127.0.0.1", port, 1,
               handlers=FenceHandlers(partitioned=lambda why: fired.append(time.monotonic())))
    m.fence_after_s = bound_s  # what join()'s welcome would set (3 x the coordinator's stale_s)
    m._sock, coord_end = socket.socketpair()  # what join() would connect
    m._heard = time.monotonic()
    threading.Thread(target=m._watchdog_loop, daemon=True).start()
    return m, coord_end, fired


def test_silence_fences_after_the_bound(store: object) -> None:
    t0 = time.monotonic()
    m, coord_end, fired = _watched_member(store, 0.4)
    _wait(fired, t0 + 5)
    # Never before the bound; the upper limit only says "soon" (under load the watchdog's 0.1 s
    # wake-ups were once late enough to pass 1.5 s).
    assert fired and 0.4 <= fired[0] - t0 <= 2.5, fired
    assert m.fenced  # type: ignore[attr-defined]
    coord_end.close()


def test_the_fence_holds_for_a_descriptor_past_1024(store: object) -> None:
    """A rank with many connections (gloo pairs, store clients) has liveness sockets past fd
    1024, where select() raises: the watchdog then returned without ever fencing."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2100:
        pytest.skip(f"the hard limit on open files ({hard}) is below 2100")
    if soft != resource.RLIM_INFINITY and soft < 2100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2100, hard))
    t0 = time.monotonic()
    m, coord_end, fired = _watched_member(store, 0.4)
    low = m._sock  # type: ignore[attr-defined]
    m._sock = socket.socket(fileno=fcntl.fcntl(low.fileno(), fcntl.F_DUPFD, 2000))  # type: ignore[attr-defined]
    low.close()
    coord_end.sendall(b"ping\n")  # unread bytes: the watchdog must look at the socket
    _wait(fired, t0 + 5)
    assert m._sock.fileno() >= 1024  # type: ignore[attr-defined]
    assert fired and 0.8 <= fired[0] - t0 <= 2.5, fired
    coord_end.close()


def test_unread_bytes_delay_but_do_not_stop_the_fence(store: object) -> None:
    """Bytes the coordinator sent but no reader took (stopped, or stuck in a store call) give
    the reader one more bound; then the watchdog fences anyway."""
    t0 = time.monotonic()
    m, coord_end, fired = _watched_member(store, 0.4)
    coord_end.sendall(b"ping\n")  # never read: no reader thread here
    _wait(fired, t0 + 5)
    assert fired and 0.8 <= fired[0] - t0 <= 2.5, fired
    coord_end.close()
