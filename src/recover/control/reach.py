"""Whether this rank's data path reaches its peers': the evidence behind a partition's eviction.

gloo's errors do not say which peer a cut separates us from (a connect that fails says
`connect: Invalid argument` or `Connect timeout [none]`; a read error names whichever peer reset
first, often a bystander: docs/MEASUREMENTS.md, "A cut between two replicas"), so a rank whose
communicator stalls or fails asks the network itself: one TCP handshake from the address its gloo
device binds to each peer's `Listener`, bound to the address that peer's gloo device binds.

Invariant: `unreachable` names a peer only when the handshake failed the way a cut fails (no
answer within the bound, or the route refused it: EHOSTUNREACH, ENETUNREACH, EINVAL of a
blackhole route, EACCES/EPERM of a filter); never when the peer's host answered (a refused
connection: its process is gone, which the coordinator's liveness socket reports), and never a
peer at an address where another peer answered (then the path to that host works: the silence
is a process's, not the network's). `PathWatch` holds one op's evidence: its probe and, for a
reduce, that it waits for someone it cannot name.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable

from recover.control.listen import listen
from recover.deadline import Deadline

log = logging.getLogger(__name__)

# How a failed handshake reads when the network (not the peer's process) failed it.
CUT_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EINVAL,
                        errno.EACCES, errno.EPERM, errno.EHOSTDOWN, errno.ENETDOWN})


class Listener:
    """Accepts handshakes on the address this rank's gloo device binds, and closes them at once.

    The kernel completes a handshake before `accept`, so a rank whose main thread (or whole
    process, SIGSTOP) is stalled still answers: this tests the path, never the process."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._sock = listen(addr, 0, backlog=1024)
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="recover-reach", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


def parse(value: bytes | str) -> tuple[str, int] | None:
    """`addr port` as published beside a gloo address (None: not a probe address)."""
    words = (value.decode() if isinstance(value, bytes) else value).split()
    if len(words) != 2 or not words[1].isdigit():
        return None
    return words[0], int(words[1])


def unreachable(source: str, peers: dict[int, tuple[str, int]], timeout_s: float) -> list[int]:
    """The peers (id -> their listener's (addr, port)) a handshake from `source` cannot reach
    within `timeout_s`, by the module's invariant; all handshakes run at once."""
    failed = handshakes(source, peers, timeout_s)
    answered = {peers[p][0] for p in peers if p not in failed}
    return sorted(p for p in failed if peers[p][0] not in answered)


def handshakes(source: str, peers: dict[int, tuple[str, int]],
               timeout_s: float) -> set[int]:
    """The peers whose handshake failed as a cut fails (timed out, or a cut errno)."""
    failed: set[int] = set()
    sel = selectors.DefaultSelector()  # epoll: no FD_SETSIZE limit on a large group
    socks: list[socket.socket] = []
    try:
        for peer, (addr, port) in peers.items():
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setblocking(False)
            try:
                s.bind((source, 0))  # the path gloo's traffic takes, not the default route's
                code = s.connect_ex((addr, port))
            except OSError as e:
                code = e.errno or errno.EINVAL
            if code in (0, errno.EISCONN):
                continue
            if code != errno.EINPROGRESS:
                if code in CUT_ERRNOS:
                    failed.add(peer)
                continue
            sel.register(s, selectors.EVENT_WRITE, peer)
        deadline = Deadline(timeout_s)
        while sel.get_map() and not deadline.passed():
            for key, _ in sel.select(deadline.left()):
                sel.unregister(key.fileobj)
                code = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)  # type: ignore[union-attr]
                if code in CUT_ERRNOS:
                    failed.add(key.data)
        failed.update(key.data for key in sel.get_map().values())  # no answer in time
    finally:
        sel.close()
        for s in socks:
            s.close()
    return failed


class Probe:
    """`unreachable` on a helper thread, so its caller keeps watching for a newer generation."""

    def __init__(self, source: str, peers: dict[int, tuple[str, int]], timeout_s: float) -> None:
        self.result: list[int] | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, peers, timeout_s),
                                        name="recover-probe", daemon=True)
        self._thread.start()

    def _run(self, source: str, peers: dict[int, tuple[str, int]], timeout_s: float) -> None:
        try:
            self.result = unreachable(source, peers, timeout_s)
        except OSError as e:  # no evidence, never a crash: the reduce's own timeout still holds
            log.warning("probing the peers' data path failed: %s", e)
            self.result = []
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


class PathWatch:
    """One communicator operation's evidence (a group build, or a reduce): a probe started once
    the op has waited `suspect_s` (or at once when it failed), reported once, to the
    coordinator, if it names anyone. `start` gives the probe (None: nothing to probe with, e.g.
    NCCL), `report` sends the names (`Member.report_cut`), `superseded` tells a newer generation
    is known. With `waiting` (tell, withdraw), past `suspect_s` it also tells once that the op
    waits for someone it cannot name (`Member.report_waiting`), withdrawn when it `ended`."""

    def __init__(self, start: Callable[[], Probe | None], report: Callable[[list[int]], None],
                 suspect_s: float,
                 waiting: tuple[Callable[[], None], Callable[[], None]] | None = None) -> None:
        self.start, self.report, self.suspect_s = start, report, suspect_s
        self.waiting, self.told = waiting, False
        self.probe: Probe | None = None
        self.tried = False

    def turn(self, waited_s: float) -> None:
        """A wait loop's turn: probe once past `suspect_s` (and tell that it waits); report what
        an ended probe found."""
        if not self.tried and waited_s >= self.suspect_s:
            self.tried = True
            self.probe = self.start()
        if self.waiting is not None and not self.told and waited_s >= self.suspect_s:
            # Maybe a member whose main thread never came (a deadlock between steps): its own
            # heartbeats say so, and this wait is the evidence against it.
            self.told = True
            self.waiting[0]()
        if self.probe is not None and self.probe.done():
            if self.probe.result:
                self.report(self.probe.result)
            self.probe = None

    def ended(self) -> None:
        """The op completed: whoever it waited for came after all (withdraw the wait)."""
        if self.told and self.waiting is not None:
            self.waiting[1]()

    def settle(self, superseded: Callable[[], bool], poll_s: float,
               answered: Callable[[], bool] | None = None) -> None:
        """The op failed: probe now (if not yet) and report before the failure is, so the
        coordinator weighs the cut before a bare rebuild request; give up on a newer
        generation (nothing of this one needs deciding any more).

        `answered()`, if given, first waits (bounded) for something else to answer the failure
        and says whether it did (a crash: the coordinator sees it by itself). Then nobody is
        probed: a probe is a handshake with every other member, O(R) for each survivor and
        O(R^2) over the group, at every crash otherwise."""
        if not self.tried and answered is not None and answered():
            return
        self.turn(self.suspect_s)
        while self.probe is not None and not superseded():
            self.probe.wait(poll_s)
            self.turn(self.suspect_s)
