"""Slow HTTP clients cannot exhaust the launcher (issue 50, item 5: the endpoint's bounds).

Invariant checked: clients that open connections and trickle a byte at a time (slowloris) hold
at most `max_connections` of the endpoint's threads and descriptors, each for at most `request_s`
however they trickle (the per-read timeout alone let one byte every 4 s hold a connection
forever); once they are cut, a well-behaved client is answered; the launcher's own thread count
and open descriptors return to where they were.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from recover.app import endpoint
from recover.app.endpoint import Endpoint, HttpConfig

pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.timeout(60)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _trickle(port: int, stop: threading.Event, cut: list[float], t0: float) -> None:
    """A slowloris client: one byte of an unfinished request every 0.2 s until it is cut."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        cut.append(0.0)
        return
    with s:
        try:
            s.sendall(b"GET /status HTTP/1.1\r\n")
            while not stop.is_set():
                s.sendall(b"X")
                s.settimeout(0.2)
                with contextlib.suppress(socket.timeout):
                    if s.recv(1) == b"":  # closed by the server
                        break
        except OSError:  # reset by the server
            pass
        cut.append(time.monotonic() - t0)


def test_slow_clients_are_capped_and_cut(tmp_path: Path) -> None:
    fds0, threads0 = _fds(), threading.active_count()
    ep = Endpoint(tmp_path, HttpConfig(port=0))
    ep.server.max_connections, ep.server.request_s = 8, 2.0
    stop, cut = threading.Event(), []
    t0 = time.monotonic()
    clients = [threading.Thread(target=_trickle, args=(ep.port, stop, cut, t0), daemon=True)
               for _ in range(40)]
    try:
        for c in clients:
            c.start()
        time.sleep(1.0)
        assert len(ep.server._live) <= 8  # served at once: the cap, never the 40
        # The server's handler threads: at most the cap (the 40 clients' own threads aside).
        handlers = [t for t in threading.enumerate() if "process_request_thread" in t.name]
        assert 1 <= len(handlers) <= 8, len(handlers)
        for c in clients:
            c.join(timeout=10)
        # Every trickler was cut: the refused at once, the served within request_s of being
        # accepted (+ a poll); one still queued when the first wave ended may be admitted then,
        # for a bound of its own: at most two bounds in all.
        assert len(cut) == 40 and max(cut) < 2 * 2.0 + 1.5, sorted(cut)[-5:]
        # A cut client's handler thread leaves the server's count a moment after its socket
        # closes: a request made before then meets the cap, closed at once (as it should be).
        deadline = time.monotonic() + 5
        while ep.server._live and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not ep.server._live, len(ep.server._live)
        with urllib.request.urlopen(f"http://127.0.0.1:{ep.port}/status", timeout=5) as r:
            assert r.status == 200
    except urllib.error.HTTPError as e:
        assert e.code == 503  # an empty directory is not a run yet: answered all the same
    finally:
        stop.set()
        ep.close()
    deadline = time.monotonic() + 5
    while (_fds() > fds0 or threading.active_count() > threads0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds() <= fds0 and threading.active_count() <= threads0


def test_defaults_bound_a_connection() -> None:
    """The shipped bounds: a whole connection well under a minute, and a cap."""
    assert endpoint.REQUEST_S <= 30 and 1 <= endpoint.MAX_CONNECTIONS <= 256
    assert endpoint._Server.request_s == endpoint.REQUEST_S
