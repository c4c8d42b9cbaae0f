"""The coordinator: the control plane's TCPStore server plus the membership logic.

Invariant: the coordinator is the only writer of generations. Generation g+1's members are
generation g's members minus every replica with evidence of loss (its liveness socket closed without
a goodbye, it went silent for --stale-s, one of its ranks reported it lost, or other members name it
and the evidence convicts it: `admission.convicted`), plus a replica admitted after its state
transfer; it is written once and never changed, and every member is told over its liveness socket.
Only a connection whose hello was accepted (valid ids, the run's token, the run's config
fingerprint, not a duplicate) can change membership, and only for its own replica; no input crashes
the loop. It runs in its own process so the store survives any worker's death (docs/DESIGN.md,
"Processes and roles"). It pings every liveness socket at least every PING_S (and every stale_s /
4), so a member that hears nothing for 3 x stale_s knows it is cut off (recover.collectives.member).
Ports: the store's, and the liveness listener's (store port + 1 when the store port is fixed, so a
firewall can be opened for both ahead of time).
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

from recover.collectives import keys, shards
from recover.collectives.admission import Hello, Join, Member, refusal
from recover.collectives.coord_evidence import Evidence
from recover.collectives.coord_joins import Admissions

DEBOUNCE_S = 0.02  # collect simultaneous failures into one generation
HB_CHECK_S = 0.05  # judge silence at most this often (heartbeats are lines on the socket)
STALL_S = 0.5  # a gap between two turns of the loop longer than this is the coordinator's own
PING_S = 0.25  # longest gap between two bytes to a member (members fence after 3 x stale_s)


MAX_LINE = 4096  # a longer line is not ours: the connection is closed


@dataclass
class _Conn:
    sock: socket.socket
    buf: bytes = b""
    replica: int | None = None  # set once its hello was accepted: only then may it say more
    rank: int = 0
    nranks: int = 1
    pid: int = 0
    said_bye: bool = False
    heard: float = field(default_factory=time.monotonic)
    stalled: bool = False  # its last heartbeat: the main thread is stalled in the step protocol


class Coordinator(Admissions, Evidence):
    """Hosts the store and decides generations. Call `start()` then `serve(stop)`."""

    def __init__(self, expected: int, host: str = "0.0.0.0", port: int = 0, stale_s: float = 2.0,
                 join_timeout_s: float = 120.0, log_path: str | None = None,
                 exit_when_done: bool = False, liveness_port: int | None = None,
                 token: str | None = None, fingerprint: str | None = None,
                 recover: bool = False, store_shards: int = 0) -> None:
        # A member must show the run's token (when set) and the fingerprint of the run's
        # trajectory-defining config (when set; else the first member's sets it): docs/DESIGN.md,
        # "Checkpoints, rejoin and trust".
        self.token, self.fingerprint = token, fingerprint
        self.heard: dict[int, _Conn] = {}  # fd -> conn, least recently heard first
        self.joins: dict[int, Join] = {}  # replica -> its admission in progress
        self.epochs = 0
        self.accusations: dict[int, set[int]] = {}  # accused -> accusers, this generation
        self.accused_since: float | None = None
        self.exit_when_done = exit_when_done
        self.expected, self.host, self.port = expected, host, port
        # Extra store servers for the step decision's counts (collectives/shards.py); 0 or 1:
        # the main store does it all.
        self.store_shards = store_shards if store_shards > 1 else 0
        self.shards: list[TCPStore] = []
        # None: store port + 1 for a fixed store port (predictable for firewalls), else any.
        self.liveness_port = liveness_port
        self.ping_s = min(PING_S, stale_s / 4)
        self._pinged = 0.0
        self.exits: dict[int, str] = {}  # replica -> how it ended, as seen from here
        self.stale_s, self.join_timeout_s = stale_s, join_timeout_s
        self.log_path = log_path
        self.generation = -1
        self.members: list[int] = []
        self.replicas: dict[int, Member] = {}
        self.lost: dict[int, str] = {}  # replica -> reason, not yet published
        self.pending_since: float | None = None
        self.all_left = False
        self._sel = selectors.DefaultSelector()
        self._hb_checked = 0.0
        self._conns: dict[int, _Conn] = {}  # fd -> conn
        # --recover: this coordinator replaces one that died. The replicas that kept running
        # re-register with the steps they applied; the first generation resumes the run
        # (`_maybe_resume`), numbered after every generation they knew.
        self.recover = recover
        self._resume: dict[int, dict[int, int]] = {}  # replica -> rank -> steps applied
        self._newest_seen = -1  # the newest generation any re-registering rank knew
        self._join_at: dict[int, int] = {}  # replica -> the step it asked to join at, if any
        self._last_hello = 0.0
        self._floor = 0  # this coordinator's first generation (older ones are not in its store)
        self._gen_count = 0  # the store's GEN_COUNT
        self._published: int | None = None  # the last generation this coordinator published

    # -- setup ---------------------------------------------------------------------------
    def start(self) -> int:
        """Start the store and the liveness listener; return the store's port."""
        self.store = keys.serve_store(self.host, self.port)
        local = self.host if self.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        self.client = keys.connect_store(local, self.store.port, 30.0)
        # Fixed ports follow the store's (liveness + 1, shards + 2...) only when the liveness
        # port is derived too; otherwise (a restarted coordinator: --liveness-port 0) any.
        fixed = self.liveness_port is None and self.port != 0
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
        # Before LIVENESS_ADDR too: a member reads the shards once it has seen the address.
        for k in range(self.store_shards):
            want = self.port + 2 + k if fixed else 0
            self.shards.append(keys.serve_store(self.host, want))
        if self.shards:
            shards.publish(self.client, [int(s.port) for s in self.shards])
        self.client.set(keys.COORD_PID, str(os.getpid()))
        self.client.set(keys.LIVENESS_ADDR, f"{socket.gethostname()}:{lport}")
        self.started = time.monotonic()
        self._log({"event": "start", "pid": os.getpid(), "port": self.store.port,
                   "liveness_port": lport,
                   "expected": self.expected,
                   "shard_ports": [int(s.port) for s in self.shards]})
        return int(self.store.port)

    def _log(self, rec: dict) -> None:
        rec = {"time": round(time.time(), 4), **rec}
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    # -- main loop -----------------------------------------------------------------------
    def serve(self, should_stop=lambda: False) -> int:
        """Run until `should_stop()`, or until every joined replica has left or been lost."""
        last = time.monotonic()
        while not should_stop():
            now = time.monotonic()
            if now - last > STALL_S:
                # This loop itself was stalled (a store call, the machine): members could not
                # be heard meanwhile, so that time is not their silence.
                for conn in self._conns.values():
                    conn.heard += now - last
            last = now
            # Sleep until an event or the next thing due (a silence check, a debounced
            # publication), not on a fixed 10 ms tick: idle turns cost the store server's cores.
            wait = HB_CHECK_S if self.generation >= 0 else 0.01
            if self.pending_since is not None:
                wait = min(wait, max(0.0, self.pending_since + DEBOUNCE_S - now))
            for key, _ in self._sel.select(timeout=wait):
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
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
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
        conn.heard = time.monotonic()
        fd = conn.sock.fileno()
        if fd in self.heard:  # least recently heard first: staleness is checked from the front
            self.heard.pop(fd)
            self.heard[fd] = conn
        while b"\n" in conn.buf:
            line, conn.buf = conn.buf.split(b"\n", 1)
            try:
                self._message(conn, line.decode(errors="replace").split())
            except (ValueError, IndexError) as e:  # malformed: ignored, and a stranger is cut
                self._log({"event": "malformed", "line": line[:200].decode(errors="replace"),
                           "error": str(e)[:200], "replica": conn.replica})
                if conn.replica is None:
                    self._drop_conn(conn)
                    return
        if len(conn.buf) > MAX_LINE:
            self._log({"event": "malformed", "line": "(overlong)", "replica": conn.replica})
            self._closed(conn)

    def _message(self, conn: _Conn, words: list[str]) -> None:
        """One line from a liveness connection. Nothing but an accepted hello is heard from a
        connection that has not been accepted; a member speaks only for its own replica."""
        if not words:
            return
        kind = words[0]
        if kind == "hello":
            self._hello(conn, words)
            return
        if conn.replica is None:
            raise ValueError(f"{kind!r} before an accepted hello")
        if kind == "hb":  # hb [<seconds the main thread has been stalled in the protocol>]
            was, conn.stalled = conn.stalled, len(words) > 1 and float(words[1]) > 0
            if conn.stalled and not was and self.accusations:
                self._judge()  # a named member's main thread stalls: the evidence may convict
            return
        if kind == "fail":  # fail <generation> [suspects]: a reduce failed; rebuild
            g = int(words[1])
            suspects = [int(r) for r in words[2].split(",")] if len(words) > 2 and \
                words[2] != "-" else []
            if g == self.generation and conn.replica in self.members:
                self._evidence(conn.replica, suspects)
        elif kind == "arrived":  # arrived <generation>: whom this rank named caught up
            if int(words[1]) == self.generation:
                self._withdraw(conn.replica)
        elif kind == "lost":  # lost <reason...>: one of this replica's ranks died
            self._mark_lost(conn.replica, "reported lost: " + " ".join(words[1:])[:200])
        elif kind == "bye":
            conn.said_bye = True
        elif kind == "ready":  # ready <epoch>: a joiner's rank holds its verified state
            self._join_ready(conn, int(words[1]))
        elif kind == "joinfail":  # joinfail <epoch>: its donor went away; try another
            self._join_failed(conn.replica, int(words[1]), "its donor went away")
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _hello(self, conn: _Conn, words: list[str]) -> None:
        h = Hello.parse(words)
        if conn.replica is not None:
            raise ValueError("a second hello on one connection")
        known = self.replicas.get(h.replica) or self.joins.get(h.replica)
        why = refusal(h, self.expected, self.token, self.fingerprint,
                      any(c.replica == h.replica and c.rank == h.rank
                          for c in self._conns.values()),
                      known.nranks if known is not None and h.replica in self.members else None)
        if why is not None:
            self._send(conn, f"refused {why}\n")
            self._log({"event": "refused", "replica": h.replica, "rank": h.rank, "pid": h.pid,
                       "why": why})
            self._drop_conn(conn)
            return
        replica, rank, nranks, pid, fingerprint = h.replica, h.rank, h.nranks, h.pid, h.fingerprint
        if self.fingerprint in (None, "-") and fingerprint != "-":
            self.fingerprint = fingerprint  # the first member's config defines the run
        conn.replica, conn.rank, conn.nranks, conn.pid = replica, rank, nranks, pid
        self.heard[conn.sock.fileno()] = conn
        self._log({"event": "hello", "replica": replica, "rank": rank, "pid": pid})
        if self.generation < 0 and self.recover:
            # Answered once the resume point is decided: welcome, or heal by state transfer.
            self.replicas.setdefault(replica, Member(nranks)).ranks.add(rank)
            self._resume.setdefault(replica, {})[rank] = h.applied
            self._join_at[replica] = max(self._join_at.get(replica, 0), h.join_at)
            self._newest_seen = max(self._newest_seen, h.generation)
            self._last_hello = time.monotonic()
            return
        if self.generation < 0 or replica in self.members:
            rep = self.replicas.setdefault(replica, Member(nranks))
            rep.ranks.add(rank)
            self._send(conn, f"welcome {self._floor}\n")
            return
        # Mid-run: admission at a step boundary, after a live state transfer (docs/DESIGN.md,
        # "Checkpoints, rejoin and trust").
        join = self.joins.setdefault(replica, Join(nranks))
        join.ranks.add(rank)
        join.at = max(join.at, h.join_at)
        self._set_exit(replica, "joining")
        if len(join.ranks) == join.nranks and join.epoch < 0:
            self._announce_join(replica, join)
        elif join.epoch >= 0:
            self._send(conn, f"joining {join.epoch} {self.generation} {self._floor}\n")

    def _drop_conn(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        self.heard.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _closed(self, conn: _Conn) -> None:
        self._drop_conn(conn)
        if conn.replica is None:
            return
        join = self.joins.get(conn.replica)
        if join is not None and conn.replica not in self.members:
            join.ranks.discard(conn.rank)
            if join.epoch >= 0:  # whoever paused a step for it goes on (a new generation)
                self._join_failed(conn.replica, join.epoch, "the joiner went away")
            if not any(c.replica == conn.replica for c in self._conns.values()):
                self.joins.pop(conn.replica, None)
                self._set_exit(conn.replica, f"lost while joining (pid {conn.pid})")
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
        """Declare silent members lost. Connections are kept least recently heard first, so
        this looks only at the few that are silent, not at every rank: O(events)."""
        if now - self._hb_checked < HB_CHECK_S:
            return
        self._hb_checked = now
        for conn in list(self.heard.values()):
            silent = now - conn.heard
            if silent <= self.stale_s:
                break
            if conn.replica in self.members and conn.replica not in self.lost:
                self._mark_lost(conn.replica, f"silent for {silent:.2f}s (rank {conn.rank})")
        if self.accused_since and now - self.accused_since > 2 * self.stale_s:
            self.accused_since = None
            self._mark_lost(None, "failed reduces named no member conclusively")
        for replica, join in list(self.joins.items()):
            if join.epoch >= 0 and now - join.since > self.join_timeout_s:
                self._join_failed(replica, join.epoch, f"no state within {self.join_timeout_s}s")

    def _maybe_first_generation(self, now: float) -> None:
        if self.recover:
            self._maybe_resume(now)
            return
        complete = sorted(r for r, rep in self.replicas.items() if len(rep.ranks) >= rep.nranks)
        timed_out = now - self.started > self.join_timeout_s
        if len(complete) >= self.expected or (timed_out and complete):
            for conn in self.heard.values():  # silence is judged from now on
                conn.heard = now
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
        # Stored: push it now, as a change to the one published last (members know it: no store
        # read for them), then write what nobody waits for (the reason; the fallback's count).
        base = self.generation if self._published == self.generation else None
        push = keys.gen_push(g, base, self.members, members)
        self.generation, self.members, self._published = g, sorted(members), g
        self.lost, self.pending_since, self.accusations, self.accused_since = {}, None, {}, None
        self._log({"event": "generation", "gen": g, "members": self.members, "reason": reason})
        for conn in list(self._conns.values()):
            self._send(conn, push)
        self.client.set(keys.reason_key(g), reason)
        self.client.add(keys.GEN_COUNT, g + 1 - self._gen_count)  # after a --recover gap too
        self._gen_count = g + 1

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
    ap.add_argument("--token-file", help="the run's secret: members must show it (default: env "
                    "RECOVER_RUN_TOKEN; none: any member is accepted)")
    ap.add_argument("--fingerprint", help="the run's config fingerprint members must match "
                    "(default: the first member's)")
    ap.add_argument("--store-shards", type=int, default=0,
                    help="also host this many store servers for the step decision's counts "
                    "(ports: store port + 2 on, unless --port 0 or --liveness-port: any); "
                    "0 or 1: none")
    ap.add_argument("--recover", action="store_true",
                    help="replace a coordinator of this run that died (same address): the "
                    "replicas re-register and the run resumes from their last committed step")
    args = ap.parse_args(argv)
    token = (Path(args.token_file).read_text().strip() if args.token_file
             else os.environ.get("RECOVER_RUN_TOKEN"))
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("flag", True))
    coord = Coordinator(args.replicas, args.host, args.port, args.stale_s, args.join_timeout_s,
                        args.log, args.exit_when_done, args.liveness_port, token or None,
                        args.fingerprint, args.recover, args.store_shards)
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
