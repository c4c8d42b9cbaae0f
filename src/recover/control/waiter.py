"""Wait for a store key without polling, and still wake at once when the membership changes.

A blocking `get` is one round trip however long it waits (the store server holds the request),
but it cannot be interrupted. So the get runs on a helper thread with its own store client, and the
caller sleeps on an event that either the helper (the key arrived) or the `Member` (a newer
generation) sets. A helper left blocked by a caller that moved on finishes on its own (the key
arrives, or its timeout) and is then reused; meanwhile another helper serves the next wait.
`close()` ends the helpers (a busy one once its get returns), so a caller that is done with the
waiter leaves no thread or store connection behind.

Invariant: `get()` returns the key's (accepted) value, or None once `generation` is superseded, the
coordinator is lost, or `timeout_s` passes; it never returns a stale result of an earlier wait.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

from recover.control.member import Member
from recover.control.spare import SpareClient
from recover.deadline import Deadline

Accept = Callable[[bytes], "bytes | None"]
FORGED_POLL_S = 0.05  # how often a value that is not accepted is read again


class _Helper:
    def __init__(self, connect: Callable[[], Any]) -> None:
        """`connect()` gives the helper its client, on the helper's own thread: a connect that
        was not made ahead (`spare`) resolves the peer's name there, which can take a DNS
        timeout (5 s): on a caller's thread after a coordinator restart, long enough to be judged
        a stalled main thread and evicted (docs/MEASUREMENTS.md, "TCPStore")."""
        self.connect = connect
        self.store: Any = None
        self.requests: queue.SimpleQueue[tuple[str, float, Accept | None, dict[str, Any],
                                               threading.Event]] = queue.SimpleQueue()
        self.busy = False
        self.dead = False
        self.closing = False
        threading.Thread(target=self._loop, name="recover-keywait", daemon=True).start()

    def _loop(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:  # close(): end the thread; its client closes with it
                self.dead = True
                return
            key, timeout_s, accept, box, done = request
            deadline = Deadline(timeout_s)
            try:
                if self.store is None:
                    self.store = self.connect()
                value: bytes | None = b""
                while not value:
                    # A blocked get also wakes when another client compare_sets the missing key
                    # without setting it (a `try_get`), and then returns b"" (docs/MEASUREMENTS.md,
                    # "TCPStore"): recover never stores an empty value, so b"" means "not yet".
                    left = deadline.left()
                    if left <= 0:
                        raise TimeoutError(f"{key!r} not set within {timeout_s:.0f}s")
                    self.store.set_timeout(datetime.timedelta(seconds=left))
                    value = self.store.get(key)
                    if value and accept is not None:
                        value = accept(value)
                        if value is None:  # not the run's (a stranger's): its writer replaces
                            deadline.sleep(FORGED_POLL_S)  # it; poll for that
                box["value"] = value
            except Exception as e:  # a timeout, or the store is gone
                # The server may still answer the timed-out wait later, on this connection: a
                # client that timed out is never used again, or it could read that stale reply.
                box["error"] = e
                self.dead = True
                done.set()
                return
            self.busy = False
            done.set()
            if self.closing:
                self.dead = True
                return


class KeyWaiter:
    """Blocking reads of one key at a time for one caller thread (`member`'s newest generation
    interrupts them)."""

    def __init__(self, member: Member, store: Any = None) -> None:
        """Waits on `store` (default: the member's own client to the main store)."""
        self.member = member
        self.store = member.store if store is None else store
        self.gets = 0  # blocking reads so far: one store round trip each (for profilers)
        self._helpers: list[_Helper] = []
        self._lock = threading.Lock()
        # A new helper is needed just when a wait was abandoned for a newer generation (its
        # helper is still blocked), i.e. in a recovery: its client is connected ahead (`spare`).
        self._spare = SpareClient(self.store.clone)

    def get(self, key: str, generation: int, timeout_s: float,
            meanwhile: Callable[[], None] | None = None,
            accept: Accept | None = None) -> bytes | None:
        """The key's value (see the module's invariant); `meanwhile()` runs once on the
        caller's thread while the request is out. `accept(raw)` (`keys.opener`: a sealed value)
        gives the value to return, or None for one that is not (a stranger's): it is waited
        past, polled every FORGED_POLL_S, until an accepted one replaces it."""
        self.gets += 1
        helper = self._idle()
        box: dict[str, Any] = {}
        done = threading.Event()
        helper.requests.put((key, timeout_s, accept, box, done))
        self.member.notify_on_change(done)  # a newer generation wakes us too
        deadline = Deadline(timeout_s)
        try:
            if meanwhile is not None:
                meanwhile()
            while True:
                if "value" in box:
                    return box["value"]
                if ("error" in box or self.member.generation() != generation
                        or self.member.coordinator_lost or deadline.passed()):
                    return None
                self.member.watch.progress()  # a legitimate wait, not a stuck thread
                done.wait(min(0.1, deadline.left()))
                done.clear()
        finally:
            self.member.notify_on_change(done, on=False)

    def close(self) -> None:
        """End the helper threads (idempotent); a wait after this starts a new helper."""
        with self._lock:
            for h in self._helpers:
                h.closing = True
                if not h.busy:
                    h.requests.put(None)
            self._helpers = []
        self._spare.close()

    def _idle(self) -> _Helper:
        with self._lock:
            self._helpers = [h for h in self._helpers if not h.dead]
            for h in self._helpers:
                if not h.busy:
                    h.busy = True
                    return h
            h = _Helper(self._spare.take)
            h.busy = True
            self._helpers.append(h)
            return h
