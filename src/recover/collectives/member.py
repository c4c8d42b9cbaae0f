"""A replica process's view of the membership: join, heartbeats, generations, fencing.

Invariant: a process only ever acts in a generation whose member list contains its replica. The
moment it learns of a newer generation without it (pushed over the liveness socket, or polled from
the store), it is fenced: it says why on stderr and exits with `EXIT_FENCED`, from a background
thread, so even a process that was stopped (SIGSTOP) and resumed cannot touch the survivors' state.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable

from recover.collectives import keys


class CoordinatorLost(RuntimeError):
    """The coordinator (and with it the store) is unreachable: training cannot go on."""


class Member:
    """Membership client of one rank of one replica.

    Threads: the caller's thread uses `store`; the heartbeat thread and the liveness-socket reader
    each have their own store client, because one client serialises its calls (DESIGN §5).
    """

    def __init__(self, host: str, port: int, replica: int, rank: int = 0, nranks: int = 1, *,
                 heartbeat_s: float = 0.1, timeout_s: float = 60.0,
                 on_fenced: Callable[[str], None] | None = None) -> None:
        self.host, self.port = host, port
        self.replica, self.rank, self.nranks = replica, rank, nranks
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self._on_fenced = on_fenced or _exit_fenced
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._gen = -1
        self._members: dict[int, list[int]] = {}
        self._stop = threading.Event()
        self._waiters: set[threading.Event] = set()  # set whenever a generation is learned
        self.coordinator_lost = False
        self.replicas = 0  # known after join()
        self.fenced = False  # set (for good) once a generation without this replica is seen
        self.store = keys.connect_store(host, port, timeout_s)

    # -- lifecycle -----------------------------------------------------------------------
    def join(self, timeout_s: float | None = None) -> int:
        """Connect the liveness socket, start heartbeats, wait for the first generation."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        addr = self._wait_key(keys.LIVENESS_ADDR, deadline).decode()
        self.replicas = int(self._wait_key(keys.REPLICAS, deadline))  # R the job started with
        lport = int(addr.rsplit(":", 1)[1])
        self._sock = socket.create_connection((self.host, lport), timeout=timeout_s)
        self._sock.settimeout(None)
        hello = f"hello {self.replica} {self.rank} {self.nranks} {os.getpid()}\n"
        self._sock.sendall(hello.encode())
        self._hb_store = self.store.clone()
        self._rd_store = self.store.clone()
        for target, name in ((self._heartbeat_loop, "recover-heartbeat"),
                             (self._reader_loop, "recover-liveness")):
            threading.Thread(target=target, name=name, daemon=True).start()
        while True:
            with self._lock:
                if self._gen >= 0:
                    return self._gen
            if self.coordinator_lost:
                raise CoordinatorLost("the coordinator went away before training started")
            if self.store.check([keys.COORD_ERROR]):
                raise CoordinatorLost(self.store.get(keys.COORD_ERROR).decode())
            if time.monotonic() > deadline:
                raise TimeoutError(f"no membership from the coordinator within {timeout_s:.0f}s")
            self._refresh(self.store)
            time.sleep(0.01)

    def leave(self) -> None:
        """Say goodbye (a clean exit is not a fault) and stop the background threads."""
        self._stop.set()
        try:
            self._sock.sendall(b"bye\n")
            # shutdown() sends the FIN at once; a bare close() would not while the reader thread
            # is blocked in recv() on this socket, and the coordinator would see the rank go
            # silent (heartbeat stale, 1 s later) instead of leaving cleanly.
            self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        except OSError:
            pass

    def report_fail(self, generation: int) -> None:
        """Tell the coordinator a reduce of `generation` failed here (forces a rebuild)."""
        self._send(f"fail {generation}\n")

    def report_lost(self, reason: str) -> None:
        """Declare this whole replica lost (one of its ranks died)."""
        self._send(f"lost {reason}\n")

    # -- queries -------------------------------------------------------------------------
    def generation(self) -> int:
        with self._lock:
            return self._gen

    def members(self, generation: int | None = None) -> list[int]:
        with self._lock:
            g = self._gen if generation is None else generation
            if g not in self._members:
                raise KeyError(f"generation {g} not known here")
            return list(self._members[g])

    def wait_newer(self, generation: int, timeout_s: float) -> int:
        """Block until a generation newer than `generation` is known; return it."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._gen <= generation:
                if self.coordinator_lost:
                    raise CoordinatorLost("the coordinator is unreachable")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no generation after {generation} within {timeout_s}s")
                self._changed.wait(min(left, 0.05))
            return self._gen

    def notify_on_change(self, event: threading.Event, on: bool = True) -> None:
        """Set `event` whenever a newer generation is learned (`on=False` stops it): lets a
        thread block on one event for "my operation finished or the membership changed"."""
        with self._lock:
            (self._waiters.add if on else self._waiters.discard)(event)

    def check(self) -> None:
        """Raise CoordinatorLost if the control plane is gone."""
        if self.coordinator_lost:
            raise CoordinatorLost("the coordinator is unreachable")

    # -- background ----------------------------------------------------------------------
    def _send(self, msg: str) -> None:
        try:
            self._sock.sendall(msg.encode())
        except OSError:
            self.coordinator_lost = True

    def _wait_key(self, key: str, deadline: float) -> bytes:
        while True:
            v = keys.try_get(self.store, key)
            if v is not None:
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator did not publish {key!r} in time")
            time.sleep(0.01)

    def _refresh(self, store) -> None:
        """Learn every generation published so far (count is bumped after members are set)."""
        count = keys.store_int(store, keys.GEN_COUNT)
        with self._lock:
            known = self._gen
        for g in range(known + 1, count):
            members = keys.decode_members(store.get(keys.members_key(g)))
            fenced = self.replica not in members
            if fenced:
                # Fence before the generation becomes visible: no thread of this process may
                # ever act in (or even see) a generation without its replica.
                self.fenced = True
                self._on_fenced(f"replica {self.replica} (pid {os.getpid()}) is not a member of "
                                f"generation {g} (members {members}): fenced, exiting")
            with self._changed:
                if g in self._members:  # the other background thread got here first
                    continue
                self._members[g] = members
                self._gen = max(self._gen, g)
                self._changed.notify_all()
                for ev in self._waiters:
                    ev.set()
            if fenced:  # a custom on_fenced returned: comm refuses to reduce from now on
                return

    def _heartbeat_loop(self) -> None:
        key = keys.heartbeat_key(self.replica, self.rank)
        while not self._stop.is_set():
            try:
                self._hb_store.add(key, 1)
                self._refresh(self._hb_store)  # a fallback for a missed push
            except Exception:
                if self._stop.is_set():
                    return
                self.coordinator_lost = True
                with self._changed:
                    self._changed.notify_all()
                return
            self._stop.wait(self.heartbeat_s)

    def _reader_loop(self) -> None:
        buf = b""
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                if not self._stop.is_set():
                    self.coordinator_lost = True
                    with self._changed:
                        self._changed.notify_all()
                return
            buf += data
            if b"\n" in buf:
                buf = buf.rsplit(b"\n", 1)[1]
                try:
                    self._refresh(self._rd_store)
                except Exception:
                    pass  # the heartbeat thread notices a dead store


def _exit_fenced(why: str) -> None:
    print(f"recover: {why}", file=sys.stderr, flush=True)
    os._exit(keys.EXIT_FENCED)
