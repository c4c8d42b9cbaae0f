"""A store client connected ahead of need, so a communicator rebuild opens no connection.

Invariant: `take()` returns a client that nobody else has used (each build gets its own: sharing an
ended build's client breaks pipes: docs/MEASUREMENTS.md, "TCPStore"), and never waits longer than a
plain connect would: a spare still connecting is left to become the next one, and the caller
connects inline.
At most one connect runs in the background at a time, on a daemon thread that exists only while
it runs; its failure is not an error (the next `take` connects inline and says why if it fails).

Why: opening a TCPStore client makes torch resolve the peer's name (docs/MEASUREMENTS.md,
"TCPStore"). Where that lookup goes to a DNS server, a noticeable share get no reply and the
connect takes the resolver's 5 s, and a rebuild opens one client per rank: with R ranks, one of
them is likely to hold up everyone's barrier. Connected right after the previous build, during
training, the lookup is off the recovery's critical path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class SpareClient:
    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._ready: Any | None = None
        self._busy = False
        self._closed = False

    def prepare(self) -> None:
        """Start connecting a spare in the background unless one is ready or on its way."""
        with self._lock:
            if self._ready is not None or self._busy or self._closed:
                return
            self._busy = True
        threading.Thread(target=self._fill, name="recover-spare-store", daemon=True).start()

    def take(self, prepare_next: bool = True) -> Any:
        """A fresh client: the spare if it is connected, else one connected now. The next spare
        is started now, or (prepare_next=False) when the caller calls `prepare`: a build
        prepares it once it is built, so the connect competes with neither the build for the
        CPU nor its socket census (`sever.opened_since`)."""
        with self._lock:
            client, self._ready = self._ready, None
        if client is None:
            client = self._connect()
        if prepare_next:
            self.prepare()
        return client

    def close(self) -> None:
        """Drop the spare (its connection closes with it) and stop making new ones."""
        with self._lock:
            self._ready, self._closed = None, True

    def _fill(self) -> None:
        try:
            client = self._connect()
        except Exception:
            client = None  # the coordinator may be gone: `take` connects inline and raises
        with self._lock:
            self._busy = False
            if not self._closed:
                self._ready = client
