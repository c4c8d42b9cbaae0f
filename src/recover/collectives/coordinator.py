"""The coordinator's process and transport: its store servers, the liveness listener and its
connections; the membership decisions are `recover.collectives.membership.Membership`'s.

Invariants: the coordinator runs in its own process, so the store survives any worker's death
(docs/DESIGN.md, "Processes and roles"). Every line read from a liveness connection is parsed
here and handed to the membership as one call; nothing but an accepted hello is heard from a
connection that has not been accepted, a malformed line is logged and ignored (a stranger sending
one is cut), and no input crashes the loop. With a run token every connection is first sent a
challenge, and once its hello proves the token over it every line each way is sealed
(collectives/session.py): one that is not is logged and ignored. Its parameters in the store are
sealed and put back within REASSERT_S of a rewrite; its event log never stops it (`EventLog`).
It pings every liveness connection at least every PING_S (and every stale_s / 4), so a member
that hears nothing for 3 x stale_s knows it is cut off (recover.collectives.member); time the
loop itself was stalled is not counted as a member's silence. Ports: the store's, and the
liveness listener's (store port + 1 when the store port is fixed, so a firewall can be opened
for both ahead of time).

A connection that has not said an accepted hello (a stranger) costs the coordinator a descriptor
and nothing else, and not for long: it is dropped HELLO_S after it was accepted, and strangers
from one address hold at most a quarter of the process's descriptors (`stranger_cap`; the
oldest is dropped to make room). So idle or slow connections can neither exhaust the descriptors
nor keep a member's hello from being heard.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import logging
import os
import resource
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed import TCPStore

from recover.collectives import keys, listen, netif, sealed, session, shards
from recover.collectives.admission import Hello, proof
from recover.collectives.coordconfig import CoordinatorConfig
from recover.collectives.membership import DEBOUNCE_S, Membership
from recover.collectives.session import Session
from recover.collectives.storecount import CountedStore, Tally
from recover.errors import ConfigError, ExitCode, RecoverError, UsageParser, usage_line
from recover.settings import LaunchEnv

log = logging.getLogger(__name__)

HB_CHECK_S = 0.05  # judge silence at most this often (heartbeats are lines on the socket)
STATS_S = 2.0  # the store-request figure (`stats_path`) is rewritten at most this often
STALL_S = 0.5  # a gap between two turns of the loop longer than this is the coordinator's own
# How often the coordinator's parameters in the store are checked and put back (`_reassert`):
# two requests a turn, against a starting member's wait for authentic ones (member.py).
REASSERT_S = 0.25
PING_S = 0.25  # longest gap between two bytes to a member (members fence after 3 x stale_s)
MAX_LINE = 4096  # a longer line is not ours: the connection is closed
# A member sends its hello in the same call that connects (recover.collectives.member): a
# connection silent this long after its accept is not a member's.
HELLO_S = 10.0
# Events worth a line in the process's log (every event goes to the JSON event log, --log).
_NOTABLE = {"start", "generation", "refused", "join", "join-failed", "resumed", "resume-failed",
            "join-timeout", "all-left", "malformed", "stranger-dropped", "suppressed"}
# Events a peer causes by what it sends (junk, a refused hello): kept at most NOISY_BURST per
# NOISY_WINDOW_S per (kind, peer address) (`EventLog`).
_NOISY = {"malformed", "stranger-dropped", "refused"}
NOISY_BURST = 20
NOISY_WINDOW_S = 10.0


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


class EventLog:
    """One JSON line per event appended to `path` (none: not kept), and the notable ones logged.

    Neither can stop the coordinator nor fill its disk on a stranger's behalf: an append that
    fails (a full disk) is reported once per episode and the events meanwhile are counted, not
    kept; the events a peer causes by sending junk (`_NOISY`) are kept at most NOISY_BURST per
    NOISY_WINDOW_S per (kind, peer), the rest counted in one `suppressed` event per window."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._failing: str | None = None  # why appends fail, while they do
        self._lost = 0  # events not kept while they failed
        self._noise: dict[tuple[str, str], list[float]] = {}  # (kind, peer) -> [since, kept, cut]

    def __call__(self, rec: dict) -> None:
        if rec.get("event") in _NOISY and not self._admit(rec):
            return
        rec = {"time": round(time.time(), 4), **rec}
        line = json.dumps(rec)
        if self.path:
            self._append(line)
        log.log(logging.INFO if rec.get("event") in _NOTABLE else logging.DEBUG, "%s", line)

    def _append(self, line: str) -> None:
        try:
            with open(self.path, "a") as f:  # type: ignore[arg-type]
                f.write(line + "\n")
        except OSError as e:
            if self._failing is None:
                log.warning("cannot append to the event log %s (%s): events are not kept until "
                            "it works again; the coordinator goes on", self.path, e.strerror or e)
            self._failing, self._lost = str(e), self._lost + 1
            return
        if self._failing is not None:
            log.warning("the event log %s takes appends again; %d event(s) were not kept",
                        self.path, self._lost)
            self._failing, self._lost = None, 0

    def _admit(self, rec: dict) -> bool:
        """Whether a noisy event is kept (see the class docstring)."""
        now = time.monotonic()
        key = (str(rec.get("event")), str(rec.get("peer", rec.get("replica"))))
        entry = self._noise.get(key)
        if entry is None or now - entry[0] > NOISY_WINDOW_S:
            cut = int(entry[2]) if entry else 0
            if len(self._noise) > 4096:  # many peers: forget the oldest windows' counts
                self._noise.clear()
            self._noise[key] = entry = [now, 0, 0]
            if cut:  # not noisy itself: no recursion
                self({"event": "suppressed", "kind": key[0], "peer": key[1], "count": cut})
        if entry[1] < NOISY_BURST:
            entry[1] += 1
            return True
        entry[2] += 1
        return False


class Coordinator:
    """Hosts the store and the liveness listener, and runs the membership over them. Call
    `start()` then `serve(stop)`."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.expected, self.host, self.port = config.replicas, config.host, config.port
        self.stale_s = config.stale_s
        self.store_shards = config.store_shards if config.store_shards > 1 else 0
        self.shards: list[TCPStore] = []
        self.top: shards.TreeTop | None = None  # decides for the shards' leaders (with shards)
        # None: store port + 1 for a fixed store port (predictable for firewalls), else any.
        self.liveness_port = config.liveness_port
        self.log_path = config.log_path
        self.exit_when_done = config.exit_when_done
        self.ping_s = min(PING_S, config.stale_s / 4)
        self._log = EventLog(config.log_path)
        self.requests = Tally()  # this process's own main-store requests
        self.requests_gone = 0  # those of the members whose connections have closed
        self._stats: tuple[float, int] = (0.0, -1)  # when written, what
        self._pinged = 0.0
        self._hb_checked = 0.0
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}  # fd -> conn
        self.heard: dict[int, _Conn] = {}  # fd -> accepted conn, least recently heard first
        self._strangers: dict[int, _Conn] = {}  # fd -> conn without an accepted hello, oldest first
        self.stranger_cap = stranger_cap()
        self.membership: Membership | None = None  # made by start(), with the store

    # The membership's state, for tests and tools (read-only).
    @property
    def generation(self) -> int:
        return self.membership.generation if self.membership else -1

    @property
    def members(self) -> list[int]:
        return self.membership.members if self.membership else []

    @property
    def exits(self) -> dict[int, str]:
        return self.membership.exits if self.membership else {}

    @property
    def accusations(self) -> dict[int, set[int]]:
        return self.membership.accusations if self.membership else {}

    @property
    def accused_since(self) -> float | None:
        return self.membership.accused_since if self.membership else None

    # -- setup ---------------------------------------------------------------------------
    def start(self) -> int:
        """Start the store and the liveness listener; return the store's port."""
        self.store = keys.serve_store(self.host, self.port)
        local = self.store.host  # the address it bound, numeric (loopback for every interface)
        self.client = CountedStore(keys.connect_store(local, self.store.port, 30.0),
                                   self.requests, "main")
        # Fixed ports follow the store's (liveness + 1, shards + 2...) only when the liveness
        # port is derived too; otherwise (a restarted coordinator: --liveness-port 0) any.
        fixed = self.liveness_port is None and self.port != 0
        want = self.liveness_port
        if want is None:
            want = self.port + 1 if self.port else 0
        try:
            self._listener = listen.listen(self.host, want, backlog=1024)  # exactly --host
        except OSError as e:
            raise OSError(f"liveness port {want} (store port + 1 unless --liveness-port is "
                          f"given): {e.strerror or e}") from None
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        lport = self.liveness_port = self._listener.getsockname()[1]
        for k in range(self.store_shards):
            want = self.port + 2 + k if fixed else 0
            self.shards.append(keys.serve_store(self.host, want))
        if self.shards:
            self.top = shards.TreeTop(self.client, self.shards, self.config.token)
        token = self.config.token
        # Sealed with the run's token (a stranger's rewrite is absent to a reader, and put back
        # by `_reassert`). A member reads only LIVENESS_ADDR (it needs it to say hello); the
        # rest reach it in its welcome (`Membership.params`) and stay here for tools.
        plain = {keys.COORD_STALE_S: repr(self.stale_s), keys.REPLICAS: str(self.expected),
                 keys.SHARDS: json.dumps([int(s.port) for s in self.shards]),
                 keys.LIVENESS_ADDR: f"{socket.gethostname()}:{lport}"}
        self._params = {k: sealed.seal(token, k, v.encode()) for k, v in plain.items()}
        # Not sealed: the launcher's fault injection reads the pid; `coord/run` is a proof.
        self._params |= {keys.COORD_PID: str(os.getpid()).encode(),
                         keys.RUN_PROOF: proof(token, keys.RUN_PURPOSE).encode()}
        self._params[keys.LIVENESS_ADDR] = self._params.pop(keys.LIVENESS_ADDR)  # written last
        for key, value in self._params.items():
            self.client.set(key, value)
        self._reasserted = time.monotonic()
        self.membership = Membership(self.config, self.client, self, self._log,
                                     started=time.monotonic())
        # A member takes these from its welcome (sealed by its session), not from the store.
        self.membership.shard_ports = [int(s.port) for s in self.shards]
        self._log({"event": "start", "pid": os.getpid(), "port": self.store.port,
                   "liveness_port": lport,
                   "expected": self.expected,
                   "shard_ports": [int(s.port) for s in self.shards]})
        return int(self.store.port)

    def close(self) -> None:
        """After `serve` returned: close the liveness connections and listener, and let the
        store servers go (their connections close with them). For a coordinator that shares its
        process with others (tests); a `recover coordinator` process just exits."""
        for conn in list(self._conns.values()):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.clear()
        self.heard.clear()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(listener)
            listener.close()
        self._sel.close()
        self.membership = None
        self.client = self.store = None  # type: ignore[assignment]
        self.shards, self.top = [], None

    # -- main loop -----------------------------------------------------------------------
    def serve(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Run until `should_stop()`, or until every joined replica has left or been lost (with
        exit_when_done)."""
        m = self.membership
        assert m is not None, "start() first"
        last = time.monotonic()
        while not should_stop():
            now = time.monotonic()
            if now - last > STALL_S:
                # This loop itself was stalled (a store call, the machine): members could not
                # be heard meanwhile, so that time is not their silence.
                for conn in self._conns.values():
                    conn.heard += now - last
                    conn.since += now - last
            last = now
            # Sleep until an event or the next thing due (a silence check, a debounced
            # publication), not on a fixed 10 ms tick: idle turns cost the store server's cores.
            wait = HB_CHECK_S if m.generation >= 0 else 0.01
            if m.pending_since is not None:
                wait = min(wait, max(0.0, m.pending_since + DEBOUNCE_S - now))
            for key, _ in self._sel.select(timeout=wait):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            now = time.monotonic()
            self._drop_silent_strangers(now)
            if now - self._reasserted >= REASSERT_S:
                self._reassert(now)
            if now - self._pinged >= self.ping_s:
                self._pinged = now
                # The generation published last rides on the ping: a member that missed its
                # push (a full send buffer drops it) learns of it within a ping, and one that
                # hears pings needs no periodic store read for generations (collectives/member.py).
                self.send_all("ping\n" if m.published is None else f"ping {m.published}\n")
            if m.generation < 0:
                if m.first_generation(now):
                    for conn in self.heard.values():  # silence is judged from now on
                        conn.heard = now
            else:
                self._check_heartbeats(now)
                if m.publish_due(now):
                    m.publish_next()
                if m.everyone_left() and self.exit_when_done:
                    m.flush_exits(final=True)  # nobody is left to publish to
                    self.write_stats(now, force=True)
                    return 0
            self.write_stats(now)
        m.flush_exits(final=True)
        self.write_stats(time.monotonic(), force=True)
        return 0

    def _reassert(self, now: float) -> None:
        """Put back any of this coordinator's parameters that a stranger rewrote or deleted (one
        store request while none was): a member reads them once, when it starts, and waits
        (bounded) for an authentic one, so a rewrite costs a starting member at most
        REASSERT_S, never its start (DESIGN.md, "Trust")."""
        self._reasserted = now
        # The newest generations' members too: one rewritten after its publication stranded a
        # joiner that read it (every rebuild after failed) until the job's bound.
        want = {**self._params, **(self.membership.recent_members if self.membership else {})}
        names = list(want)
        try:
            held = self.client.multi_get(names) if self.client.check(names) else []
        except Exception as e:  # the store is this process's own: an error is logged, not fatal
            log.warning("could not read back the coordinator's parameters: %s", e)
            return
        wrong = [k for k, v in zip(names, held, strict=True) if v != want[k]] \
            if held else names
        for key in wrong:
            sealed.rejected(key, "rewritten by someone else; put back")
            self.client.set(key, want[key])

    def store_requests(self) -> int:
        """Requests of the main store so far: this process's, and every member's as its last
        heartbeat said (members that left keep their last figure)."""
        live = sum(c.requests for c in self._conns.values())
        return self.requests.total("main") + self.requests_gone + live

    def write_stats(self, now: float, force: bool = False) -> None:
        """Rewrite `stats_path` (atomically: a reader sees the old figure or the new) when
        the figure changed, at most every STATS_S unless forced."""
        path = self.config.stats_path
        if path is None or (not force and now - self._stats[0] < STATS_S):
            return
        total = self.store_requests()
        if total != self._stats[1]:
            tmp = f"{path}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump({"time": round(time.time(), 4), "store_requests": total}, f)
                os.replace(tmp, path)
            except OSError as e:  # a full disk must not stop the membership; tried again later
                log.warning("cannot write %s: %s", path, e)
        self._stats = (now, total)

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
        if self.config.token:  # the hello must prove the token over this (collectives/session)
            conn.challenge = session.nonce()
            self._send(conn, f"challenge {conn.challenge}\n")

    def _drop_silent_strangers(self, now: float) -> None:
        """Drop the connections that said no accepted hello within HELLO_S (oldest first, so
        this looks at the expired ones only)."""
        while self._strangers:  # called every turn of the loop: no copy of the strangers
            conn = next(iter(self._strangers.values()))
            if now - conn.since <= HELLO_S:
                break
            self._drop_stranger(conn, f"no hello within {HELLO_S:g}s")

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
        wire format: recover.collectives.member, which writes these lines)."""
        if not words:
            return
        m = self.membership
        assert m is not None
        kind = words[0]
        if kind == "hello":
            h = Hello.parse(words)
            if conn.accepted:
                raise ValueError("a second hello on one connection")
            token = self.config.token
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

    def _check_heartbeats(self, now: float) -> None:
        """Tell the membership of silent connections. They are kept least recently heard first,
        so this looks only at the few that are silent, not at every rank: O(events)."""
        if now - self._hb_checked < HB_CHECK_S:
            return
        self._hb_checked = now
        m = self.membership
        assert m is not None
        for fd, conn in list(self.heard.items()):
            silent = now - conn.heard
            if silent <= self.stale_s:
                break
            m.silent(fd, silent)
        m.check_timeouts(now)

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


def raise_descriptor_limit() -> None:
    """Lift this process's soft limit on open files to the hard one: a coordinator holds a
    liveness connection per rank and the store's connections (three per rank)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)


def main(argv: list[str] | None = None) -> int:
    """`recover coordinator` / `python -m recover.collectives.coordinator`: run a coordinator
    until stopped (SIGTERM, SIGINT), or until every replica is done with --exit-when-done."""
    # Every bad flag, value or file ends here in one line and exit 2, before anything starts.
    ap: argparse.ArgumentParser = UsageParser(prog="recover coordinator")
    CoordinatorConfig.add_arguments(ap)
    try:
        config = CoordinatorConfig.from_args(ap.parse_args(argv))  # validated as it is built
        config.check_outputs()
        token = config.file_token() if config.token_file else LaunchEnv.from_env().token
        if not token and not config.no_token and not _loopback_only(config.host):
            raise ConfigError(
                f"--host {config.host} is reachable from other hosts and no token is set: give "
                "--token-file FILE (or RECOVER_RUN_TOKEN) and the same token to the workers, or "
                "--no-token to admit any process that reaches the ports")
    except RecoverError as e:
        return usage_line(ap.prog, e)
    config = dataclasses.replace(config, token=token)
    _log_to_stderr()
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("flag", True))
    raise_descriptor_limit()
    coord = Coordinator(config)
    try:
        port = coord.start()
    except Exception as e:
        log.error("recover coordinator: cannot start on port %d: %s", config.port,
                  str(e).splitlines()[0])
        return int(ExitCode.USAGE)
    if config.port_file:
        tmp = Path(config.port_file + ".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, config.port_file)
    log.info("recover coordinator: store on port %d, liveness on port %s", port,
             coord.liveness_port)
    return coord.serve(lambda: stop["flag"])


def _loopback_only(host: str) -> bool:
    """Whether `host` binds a loopback address only (a name is resolved as `listen` would; one
    that does not resolve is left to `start`, which names it)."""
    try:
        _, addr = listen.resolve(host, 0)
    except listen.ListenError:
        return True
    return netif.is_loopback(str(addr[0]))


def _log_to_stderr() -> None:
    """The process's own log, unless its parent set one up (a fork server's child inherits it)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=LaunchEnv.from_env().log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
