"""The coordinator's liveness listener and its connections: each accepted, read line by line, and
each line parsed into one call of the membership (`recover.control.membership.Membership`), whose
`Wire` it is (`send`, `send_all`).

Invariants: nothing but an accepted hello is heard from a connection that has not been accepted; a
malformed line is logged and ignored (a stranger sending one is cut), and no input crashes the
coordinator's loop. With a run token every connection is first sent a challenge, and once its hello
proves the token over it every line each way is sealed (control/session.py): one that is not is
logged and ignored. A stranger (a connection without an accepted hello) costs a descriptor and
nothing else, and not for long: it is dropped `hello_s` after its accept (`drop_silent_strangers`),
and strangers from one address hold at most `stranger_cap()` descriptors (the oldest is dropped to
make room), so idle or slow connections can neither exhaust the descriptors nor keep a member's
hello from being heard. A stranger hears its challenge and the answer to its hello, no ping and no
push. Accepted connections are kept least recently heard first, so finding the silent ones looks
at those alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import resource
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from recover.control import listen, session, shards
from recover.control.admission import Hello, proof
from recover.control.membership import Membership
from recover.control.session import Session

MAX_LINE = 4096  # a longer line is not ours: the connection is closed


@dataclass
class _Conn:
    """One liveness connection's socket side; what it said of itself is the membership's."""

    sock: socket.socket
    addr: str = ""  # the peer's address
    buf: bytes = b""
    accepted: bool = False  # its hello was accepted: only then may it say more
    heard: float = field(default_factory=time.monotonic)
    since: float = field(default_factory=time.monotonic)  # accepted by the listener
    requests: int = 0  # the member's main-store requests so far, as its last heartbeat said
    challenge: str = ""  # the nonce its hello must prove the token over (a run with a token)
    session: Session | None = None  # its sealed lines, once its hello's proof verified


class LivenessListener:
    """The listener and its connections. `open` it, give it the `membership` (and the store
    shards' `top`, if any), then `poll` it from the coordinator's loop; `log`: one event record."""

    def __init__(self, token: str | None, log: Callable[[dict], None], hello_s: float) -> None:
        self.token, self.hello_s = token, hello_s
        self._log = log
        self.membership: Membership | None = None  # what the connections' lines are told to
        self.top: shards.TreeTop | None = None  # decides for the shards' leaders (with shards)
        self.requests_gone = 0  # the main-store requests of members whose connections closed
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}  # fd -> conn
        self.heard: dict[int, _Conn] = {}  # fd -> accepted conn, least recently heard first
        self._strangers: dict[int, _Conn] = {}  # fd -> conn without an accepted hello, oldest first
        self.stranger_cap = stranger_cap()

    def open(self, host: str, port: int) -> int:
        """Listen on exactly `host` at `port` (0: any); return the port."""
        self._listener = listen.listen(host, port, backlog=1024)
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        return int(self._listener.getsockname()[1])

    def close(self) -> None:
        """Close the connections and the listener (after the coordinator's loop returned)."""
        for conn in list(self._conns.values()):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.clear()
        self.heard.clear()
        if self._listener is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(self._listener)
            self._listener.close()
        self._sel.close()
        self.membership, self.top = None, None

    # -- the coordinator's loop ------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        """Accept and read whatever is ready within `timeout` seconds."""
        for key, _ in self._sel.select(timeout=timeout):
            if key.data is None:
                self._accept()
            else:
                self._read(key.data)

    def excuse(self, gap: float) -> None:
        """The coordinator's loop itself was stalled for `gap` seconds: members could not be
        heard meanwhile, so that time is not their silence (nor a stranger's wait for a hello)."""
        for conn in self._conns.values():
            conn.heard += gap
            conn.since += gap

    def heard_now(self, now: float) -> None:
        """Judge every accepted connection's silence from `now` (the first generation)."""
        for conn in self.heard.values():
            conn.heard = now

    def tell_silent(self, now: float, stale_s: float) -> None:
        """Tell the membership of the accepted connections silent for over `stale_s`. They are
        kept least recently heard first, so this looks only at the few that are silent, not at
        every rank: O(events)."""
        m = self.membership
        assert m is not None
        for fd, conn in list(self.heard.items()):
            silent = now - conn.heard
            if silent <= stale_s:
                break
            m.silent(fd, silent)

    def drop_silent_strangers(self, now: float) -> None:
        """Drop the connections that said no accepted hello within `hello_s` (oldest first, so
        this looks at the expired ones only)."""
        while self._strangers:  # called every turn of the loop: no copy of the strangers
            conn = next(iter(self._strangers.values()))
            if now - conn.since <= self.hello_s:
                break
            self._drop_stranger(conn, f"no hello within {self.hello_s:g}s")

    def requests(self) -> int:
        """The members' main-store requests: each open connection's as its last heartbeat said,
        and the last figure of each that closed."""
        return self.requests_gone + sum(c.requests for c in self._conns.values())

    # -- its connections -----------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, addr = self._listener.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE) and self._strangers:
                # Out of descriptors: a stranger's is the one to give back, not a member's.
                self._drop_stranger(next(iter(self._strangers.values())), "out of descriptors")
            return
        sock.setblocking(False)
        conn = _Conn(sock, addr=str(addr[0]))
        same = [c for c in self._strangers.values() if c.addr == conn.addr]
        if len(same) >= self.stranger_cap:
            self._drop_stranger(same[0], f"over {self.stranger_cap} connections without a hello "
                                         f"from {conn.addr}")
        fd = sock.fileno()
        self._conns[fd] = conn
        self._strangers[fd] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)
        if self.token:  # the hello must prove the token over this (control/session)
            conn.challenge = session.nonce()
            self._send(conn, f"challenge {conn.challenge}\n")

    def _drop_stranger(self, conn: _Conn, why: str) -> None:
        self._log({"event": "stranger-dropped", "peer": conn.addr, "why": why})
        self._drop_conn(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:  # connection reset: the peer died
            data = b""
        if not data:
            self._closed(conn)
            return
        conn.buf += data
        conn.heard = time.monotonic()
        fd = conn.sock.fileno()
        if fd in self.heard:  # least recently heard first: staleness is checked from the front
            self.heard.pop(fd)
            self.heard[fd] = conn
        while b"\n" in conn.buf:
            line, conn.buf = conn.buf.split(b"\n", 1)
            if conn.session is not None:
                opened = conn.session.open(line)
                if opened is None:  # not sealed for this session: a relay's, or a replay
                    self._log({"event": "malformed", "line": line[:200].decode(errors="replace"),
                               "error": "not sealed for this connection's session",
                               "replica": self._replica(fd), "peer": conn.addr})
                    continue
                line = opened
            try:
                self._message(fd, conn, line.decode(errors="replace").split())
            except (ValueError, IndexError) as e:  # malformed: ignored, and a stranger is cut
                self._log({"event": "malformed", "line": line[:200].decode(errors="replace"),
                           "error": str(e)[:200], "replica": self._replica(fd), "peer": conn.addr})
                if not conn.accepted:
                    self._drop_conn(conn)
                    return
        if len(conn.buf) > MAX_LINE:
            self._log({"event": "malformed", "line": "(overlong)", "replica": self._replica(fd),
                       "peer": conn.addr})
            self._closed(conn)

    def _replica(self, fd: int) -> int | None:
        peer = self.membership.peers.get(fd) if self.membership else None
        return None if peer is None else peer.replica

    def _message(self, fd: int, conn: _Conn, words: list[str]) -> None:
        """One line from a liveness connection, parsed into one call of the membership (the
        wire format: recover.control.member, which writes these lines)."""
        if not words:
            return
        m = self.membership
        assert m is not None
        kind = words[0]
        if kind == "hello":
            h = Hello.parse(words)
            if conn.accepted:
                raise ValueError("a second hello on one connection")
            token = self.token
            if token:  # proved over this connection's challenge, or not at all
                good = session.proof_ok(token, conn.challenge, words)
                h = dataclasses.replace(h, token=proof(token) if good else "-")
                if good:  # its answer is sealed already
                    conn.session = session.Session(token, conn.challenge, words[5], "c")
            if m.hello(fd, h):
                conn.accepted = True
                self._strangers.pop(fd, None)
                self.heard[fd] = conn
            else:
                self._drop_conn(conn)
            return
        if not conn.accepted:
            raise ValueError(f"{kind!r} before an accepted hello")
        if kind == "hb":  # hb [<seconds stalled in the protocol> [<main-store requests>]]
            if len(words) > 2:
                conn.requests = max(conn.requests, int(words[2]))
            m.heartbeat(fd, float(words[1]) if len(words) > 1 else 0.0)
        elif kind == "fail":  # fail <generation> [suspects]: a reduce failed; rebuild
            suspects = [int(r) for r in words[2].split(",")] if len(words) > 2 and \
                words[2] != "-" else []
            m.failed(fd, int(words[1]), suspects)
        elif kind == "cut":  # cut <generation> <r1,...>: its data path cannot reach them
            m.cut(fd, int(words[1]), [int(r) for r in words[2].split(",")])
        elif kind == "arrived":  # arrived <generation>: whom this rank named caught up
            m.arrived(fd, int(words[1]))
        elif kind == "wait":  # wait <generation> <its span between steps, s>: its op waits
            m.waiting(fd, int(words[1]), float(words[2]) if len(words) > 2 else 0.0)
        elif kind == "lost":  # lost <reason...>: one of this replica's ranks died
            m.reported_lost(fd, " ".join(words[1:]))
        elif kind == "bye":  # bye [<main-store requests> [<reason>]]: a clean leave
            rest = words[1:]
            if rest and rest[0].isdigit():
                conn.requests = max(conn.requests, int(rest.pop(0)))
            m.bye(fd, " ".join(rest[:1]))  # the reason: "preempted"; none: the run ended
        elif kind == "ready":  # ready <epoch>: a joiner's rank holds its verified state
            m.ready(fd, int(words[1]))
        elif kind == "donated":  # donated <epoch> <replica>: its rank's state reached the joiner
            m.donated(fd, int(words[1]), int(words[2]))
        elif kind == "joinfail":  # joinfail <epoch>: its donor went away; try another
            m.donor_gone(fd, int(words[1]))
        elif kind == "counted" and self.top is not None:
            # counted <tag> <g> <shard> <shards used> <value>: a store shard's count is complete
            self.top.counted(words[1:])
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _drop_conn(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock.fileno(), None) is not None:
            self.requests_gone += conn.requests
        self.heard.pop(conn.sock.fileno(), None)
        self._strangers.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _closed(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        self._drop_conn(conn)
        if self.membership is not None:
            self.membership.closed(fd)

    # -- the membership's Wire -------------------------------------------------------------------
    def send(self, conn: int, msg: str) -> None:
        """To one connection (by its id); a dead one's end is seen by the selector."""
        c = self._conns.get(conn)
        if c is not None:
            self._send(c, msg)

    def send_all(self, msg: str) -> None:
        """To every member whose hello was accepted (a stranger hears nothing, pings included)."""
        for c in list(self.heard.values()):
            self._send(c, msg)

    def _send(self, conn: _Conn, msg: str) -> None:
        if conn.session is not None:
            msg = conn.session.seal(msg)
        try:
            conn.sock.sendall(msg.encode())
        except OSError:
            pass  # its death is seen by the selector


def stranger_cap() -> int:
    """How many connections without an accepted hello one address may hold: a quarter of this
    process's descriptors (at least 8), so strangers never starve the members' connections."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 4096 if soft == resource.RLIM_INFINITY else max(8, soft // 4)
