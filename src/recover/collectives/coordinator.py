"""The coordinator: the control plane's TCPStore server plus the membership logic.

Invariant: the coordinator is the only writer of generations. Generation g+1's members are
generation g's members minus every replica with evidence of loss (its liveness socket closed without
a goodbye, its heartbeats went stale, or one of its ranks reported it lost); it is written once and
never changed, and every member is told over its liveness socket. It runs in its own process so the
store survives any worker's death (DESIGN §2). It pings every liveness socket at least every
PING_S (and every stale_s / 4), so a member that hears nothing for 3 x stale_s knows it is cut off
(recover.collectives.member). Ports: the store's, and the liveness listener's (store port + 1 when
the store port is fixed, so a firewall can be opened for both ahead of time).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed import TCPStore

from recover.collectives import keys

DEBOUNCE_S = 0.02  # collect simultaneous failures into one generation
HB_CHECK_S = 0.05  # read heartbeat counters at most this often (each read is a store round trip)
PING_S = 0.25  # longest gap between two bytes to a member (members fence after 3 x stale_s)


@dataclass
class _Conn:
    sock: socket.socket
    buf: bytes = b""
    replica: int | None = None
    rank: int = 0
    nranks: int = 1
    pid: int = 0
    said_bye: bool = False


@dataclass
class _Replica:
    nranks: int
    ranks: set[int] = field(default_factory=set)
    hb: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (counter, seen at)


class Coordinator:
    """Hosts the store and decides generations. Call `start()` then `serve(stop)`."""

    def __init__(self, expected: int, host: str = "0.0.0.0", port: int = 0, stale_s: float = 2.0,
                 join_timeout_s: float = 120.0, log_path: str | None = None,
                 exit_when_done: bool = False, liveness_port: int | None = None) -> None:
        self.exit_when_done = exit_when_done
        self.expected, self.host, self.port = expected, host, port
        # None: store port + 1 for a fixed store port (predictable for firewalls), else any.
        self.liveness_port = liveness_port
        self.ping_s = min(PING_S, stale_s / 4)
        self._pinged = 0.0
        self.exits: dict[int, str] = {}  # replica -> how it ended, as seen from here
        self.stale_s, self.join_timeout_s = stale_s, join_timeout_s
        self.log_path = log_path
        self.generation = -1
        self.members: list[int] = []
        self.replicas: dict[int, _Replica] = {}
        self.lost: dict[int, str] = {}  # replica -> reason, not yet published
        self.pending_since: float | None = None
        self.all_left = False
        self._sel = selectors.DefaultSelector()
        self._hb_checked = 0.0
        self._conns: dict[int, _Conn] = {}  # fd -> conn

    # -- setup ---------------------------------------------------------------------------
    def start(self) -> int:
        """Start the store and the liveness listener; return the store's port."""
        self.store = TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                              use_libuv=True)
        self.client = keys.connect_store("127.0.0.1", self.store.port, 30.0)
        want = self.liveness_port
        if want is None:
            want = self.port + 1 if self.port else 0
        try:
            self._listener = socket.create_server((self.host, want), backlog=1024)
        except OSError as e:
            raise OSError(f"liveness port {want} (store port + 1 unless --liveness-port is "
                          f"given): {e.strerror or e}") from None
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        lport = self.liveness_port = self._listener.getsockname()[1]
        # Before LIVENESS_ADDR: a member that sees the address can read the fence bound's base.
        self.client.set(keys.COORD_STALE_S, repr(self.stale_s))
        self.client.set(keys.REPLICAS, str(self.expected))
        self.client.set(keys.LIVENESS_ADDR, f"{socket.gethostname()}:{lport}")
        self.started = time.monotonic()
        self._log({"event": "start", "pid": os.getpid(), "port": self.store.port,
                   "liveness_port": lport,
                   "expected": self.expected})
        return int(self.store.port)

    def _log(self, rec: dict) -> None:
        rec = {"time": round(time.time(), 4), **rec}
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    # -- main loop -----------------------------------------------------------------------
    def serve(self, should_stop=lambda: False) -> int:
        """Run until `should_stop()`, or until every joined replica has left or been lost."""
        while not should_stop():
            for key, _ in self._sel.select(timeout=0.01):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            now = time.monotonic()
            if now - self._pinged >= self.ping_s:
                self._pinged = now
                for conn in list(self._conns.values()):
                    self._send(conn, "ping\n")
            if self.generation < 0:
                self._maybe_first_generation(now)
            else:
                self._check_heartbeats(now)
                if self.pending_since is not None and now - self.pending_since >= DEBOUNCE_S:
                    self._publish_next()
                # A dropped member cut off by a partition keeps its connection open (no FIN
                # arrives) until the link returns: only members' connections count here.
                member_conns = any(c.replica in self.members for c in self._conns.values())
                if not self.members and not member_conns and not self.all_left:
                    self.all_left = True
                    self._log({"event": "all-left"})
                    if self.exit_when_done:
                        return 0
        return 0

    def _accept(self) -> None:
        sock, _ = self._listener.accept()
        sock.setblocking(False)
        conn = _Conn(sock)
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

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
        while b"\n" in conn.buf:
            line, conn.buf = conn.buf.split(b"\n", 1)
            self._message(conn, line.decode(errors="replace").split())

    def _message(self, conn: _Conn, words: list[str]) -> None:
        if not words:
            return
        kind = words[0]
        if kind == "hello":  # hello <replica> <rank> <nranks> <pid>
            conn.replica, conn.rank, conn.nranks, conn.pid = (int(w) for w in words[1:5])
            if self.generation >= 0 and conn.replica not in self.members:
                # No rejoin mid-run: a late or fenced process is told so and must exit.
                self._send(conn, f"gen {self.generation}\n")
                self._log({"event": "rejected", "replica": conn.replica, "pid": conn.pid})
                self._set_exit(conn.replica, "fenced: tried to join after the start", keep=True)
                return
            rep = self.replicas.setdefault(conn.replica, _Replica(conn.nranks))
            rep.ranks.add(conn.rank)
            rep.hb[conn.rank] = (-1, time.monotonic())
            self._log({"event": "hello", "replica": conn.replica, "rank": conn.rank,
                       "pid": conn.pid})
        elif kind == "fail":  # fail <generation>: a reduce failed; rebuild even if nobody died
            if int(words[1]) == self.generation and conn.replica in self.members:
                self._mark_lost(None, f"reduce failed at replica {conn.replica}")
        elif kind == "lost":  # lost <reason...>: one of this replica's ranks died
            self._mark_lost(conn.replica, "reported lost: " + " ".join(words[1:]))
        elif kind == "bye":
            conn.said_bye = True

    def _closed(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        self._sel.unregister(conn.sock)
        conn.sock.close()
        if conn.replica is None:
            return
        if conn.said_bye:
            # A clean exit is not a fault, but the others must stop counting on it: the next
            # generation leaves it out (at the end of training nobody is waiting any more).
            if conn.replica in self.members and self._replica_gone(conn.replica):
                self._set_exit(conn.replica, "left cleanly")
                self._mark_lost(conn.replica, "left cleanly")
            return
        why = f"connection closed (pid {conn.pid} rank {conn.rank})"
        if conn.replica in self.members and conn.replica not in self.lost:
            self._set_exit(conn.replica, f"lost: {why}")
        self._mark_lost(conn.replica, why)

    def _replica_gone(self, replica: int) -> bool:
        return not any(c.replica == replica for c in self._conns.values())

    def _mark_lost(self, replica: int | None, reason: str) -> None:
        if replica is not None:
            if self.generation < 0:
                self.replicas.pop(replica, None)  # died before the first generation
                self._set_exit(replica, f"lost before the start: {reason}")
                self._log({"event": "lost-before-start", "replica": replica, "reason": reason})
                return
            if replica not in self.members or replica in self.lost:
                return
            self.lost[replica] = reason
            # Dropped while its connection is still open (silent: hung or cut off), it must
            # fence itself; otherwise the caller already said how it ended.
            if not self._replica_gone(replica):
                self._set_exit(replica, f"fenced: {reason}", keep=True)
        self._log({"event": "evidence", "replica": replica, "reason": reason})
        if self.pending_since is None:
            self.pending_since = time.monotonic()

    def _set_exit(self, replica: int, how: str, keep: bool = False) -> None:
        """Record how a replica ended (first word: left / lost / fenced) for the launcher."""
        if keep and self.exits.get(replica, "running") != "running":
            return  # already ended one way; a later sign (its connection closing) changes nothing
        self.exits[replica] = how
        self._write_exits()

    def _write_exits(self) -> None:
        self.client.set(keys.COORD_EXITS,
                        json.dumps({str(r): v for r, v in sorted(self.exits.items())}))

    def _check_heartbeats(self, now: float) -> None:
        # Each read is timed on its own: under load one store round trip can take a good part of
        # a second, and stamping every rank with the loop's start time made the ranks read last
        # (rank 1 of a multi-rank replica) look silent for longer than they were. The silence
        # measured (before this read - after the read that last saw a change) is a lower bound.
        if now - self._hb_checked < HB_CHECK_S:
            return
        self._hb_checked = now
        for rid in self.members:
            rep = self.replicas.get(rid)
            if rep is None or rid in self.lost:
                continue
            for rank in rep.ranks:
                t0 = time.monotonic()
                value = keys.store_int(self.client, keys.heartbeat_key(rid, rank))
                last, seen = rep.hb.get(rank, (-1, t0))
                if value != last:
                    rep.hb[rank] = (value, time.monotonic())
                elif t0 - seen > self.stale_s:
                    self._mark_lost(rid, f"heartbeat stale for {t0 - seen:.2f}s (rank {rank})")
                    break

    def _maybe_first_generation(self, now: float) -> None:
        complete = sorted(r for r, rep in self.replicas.items() if len(rep.ranks) >= rep.nranks)
        timed_out = now - self.started > self.join_timeout_s
        if len(complete) >= self.expected or (timed_out and complete):
            for rep in self.replicas.values():  # heartbeats are judged from now on
                rep.hb = {rank: (-1, now) for rank in rep.ranks}
            self._publish(complete, "initial membership")
            self.exits.update({r: "running" for r in complete})
            self._write_exits()
        elif timed_out:
            self.client.set(keys.COORD_ERROR, f"no replica joined within {self.join_timeout_s}s")
            self._log({"event": "join-timeout"})
            self.generation = 0
            self.members = []

    def _publish_next(self) -> None:
        members = [m for m in self.members if m not in self.lost]
        reason = "; ".join(f"replica {r}: {why}" for r, why in sorted(self.lost.items()))
        self._publish(members, reason or "rebuild after a failed reduce")

    def _publish(self, members: list[int], reason: str) -> None:
        g = self.generation + 1
        value = keys.encode_members(members)
        stored = self.client.compare_set(keys.members_key(g), "", value)
        if stored != value:  # only possible if two coordinators share a store: refuse loudly
            raise RuntimeError(f"generation {g} already has members {stored!r}")
        self.client.set(keys.reason_key(g), reason)
        self.client.add(keys.GEN_COUNT, 1)
        self.generation, self.members = g, sorted(members)
        self.lost, self.pending_since = {}, None
        self._log({"event": "generation", "gen": g, "members": self.members, "reason": reason})
        for conn in list(self._conns.values()):
            self._send(conn, f"gen {g}\n")

    def _send(self, conn: _Conn, msg: str) -> None:
        try:
            conn.sock.sendall(msg.encode())
        except OSError:
            pass  # its death is seen by the selector


def main(argv: list[str] | None = None) -> int:
    """`python -m recover.collectives.coordinator`: run a coordinator until stopped."""
    ap = argparse.ArgumentParser(prog="recover coordinator")
    ap.add_argument("--replicas", type=int, required=True, help="replicas expected to join")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=29600, help="store port (0 = any free port)")
    ap.add_argument("--liveness-port", type=int, default=None,
                    help="liveness listener port (default: store port + 1; any if --port 0)")
    ap.add_argument("--port-file", help="write the chosen store port to this file")
    ap.add_argument("--stale-s", type=float, default=2.0, help="heartbeat silence = lost")
    ap.add_argument("--join-timeout-s", type=float, default=120.0)
    ap.add_argument("--log", help="append one JSON line per event to this file")
    ap.add_argument("--exit-when-done", action="store_true",
                    help="exit once every replica has left or been lost")
    args = ap.parse_args(argv)
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("flag", True))
    coord = Coordinator(args.replicas, args.host, args.port, args.stale_s, args.join_timeout_s,
                        args.log, args.exit_when_done, args.liveness_port)
    try:
        port = coord.start()
    except Exception as e:
        print(f"recover coordinator: cannot start on port {args.port}: "
              f"{str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, args.port_file)
    print(f"recover coordinator: store on port {port}, liveness on port {coord.liveness_port}",
          flush=True)
    return coord.serve(lambda: stop["flag"])


if __name__ == "__main__":
    sys.exit(main())
