"""A replica process's view of the membership: join, heartbeats, generations, fencing.

Invariant: a process only ever acts in a generation whose member list contains its replica. The
moment it learns of a newer generation without it (pushed over the liveness socket, or polled from
the store), it is fenced: it logs why and exits with `ExitCode.FENCED`, from a background
thread, so even a process that was stopped (SIGSTOP) and resumed cannot touch the survivors' state.
A process cut off from the coordinator (no byte on the liveness socket, which the coordinator
pings, for `fence_after_s` = 3 x its --stale-s) exits with `ExitCode.PARTITIONED`, also from a
background thread: TCPStore calls have no timeout on a silent link (an `add` blocks for as long as
the link is silent: docs/MEASUREMENTS.md, "Liveness and detection"), so no thread that waits on
the store or the socket may be the one to fence.
The coordinator drops a silent member after --stale-s, well before the member gives up on it.
The coordinator's parameters (--stale-s, R, its store shards' ports) are taken from the answer to
this process's hello (`welcome`/`joining`, sealed by the session in a run with a token), never
from the store; only the liveness address, needed to say hello at all, is read there (sealed).
What a process shows at its hello (`Identity`) is given by its caller; nothing here reads the
environment.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recover.control import keys, sealed, session, shards
from recover.control.admission import proof
from recover.control.netif import is_loopback
from recover.control.storecount import CountedStore, Tally
from recover.control.watchdog import ProgressWatch
from recover.deadline import Deadline, wait_until
from recover.errors import ExitCode, RecoverError
from recover.settings import MAX_REPLICAS, FaultTolerance

log = logging.getLogger(__name__)

FENCE_STALE_FACTOR = 3.0  # silence bound = this x the coordinator's --stale-s
READ_TICK_S = 0.1  # every liveness-socket read and the watchdog wake up at least this often
REFRESH_S = 2.0  # the store is read for generations this often even without a push
# The goodbye word (`leave`) of a replica leaving at a preemption (SIGTERM): the coordinator
# records it (`membership.clean_leave`), the launcher tells a preempted replica by it.
PREEMPTED = "preempted"


class CoordinatorLost(RecoverError, RuntimeError):
    """The coordinator (and with it the store) is unreachable: training cannot go on."""


class CoordinatorGone(CoordinatorLost):
    """The coordinator's connection closed (its process died) while this process was joining:
    a restarted one may be joined again (unlike a refusal, which is final)."""


class RunOver(CoordinatorLost):
    """Every member left (the run finished) while this process waited to be admitted: there is
    nothing left to join, and nothing failed."""


@dataclass(frozen=True)
class Identity:
    """What a process shows the coordinator at its hello, beyond its replica and rank ids."""

    # The run's secret (the launcher's RECOVER_RUN_TOKEN; None: "-") and a fingerprint of the
    # run's trajectory-defining config: a mismatch is refused.
    token: str | None = None
    fingerprint: str = "-"
    join_at: int = 0  # a replacement asks not to be admitted before this step
    # A process that was running when its coordinator died tells a restarted one where it
    # stands (steps applied, newest generation); -1: it holds no run state.
    applied: int = -1
    last_generation: int = -1


@dataclass(frozen=True)
class FenceHandlers:
    """What a process does when it must stop acting (each gets the reason, one line). None: log
    the reason and exit at once with `ExitCode.FENCED`, `PARTITIONED` or `STUCK`."""

    fenced: Callable[[str], None] | None = None  # a generation without its replica was seen
    partitioned: Callable[[str], None] | None = None  # the coordinator was silent too long
    stuck: Callable[[str], None] | None = None  # the armed main thread made no progress


class Member:
    """Membership client of one rank of one replica.

    Threads: the caller's thread uses `store`; the heartbeat thread and the liveness-socket reader
    each have their own store client, because one client serialises its calls
    (docs/MEASUREMENTS.md, "TCPStore").
    """

    def __init__(self, host: str, port: int, replica: int, rank: int = 0, nranks: int = 1, *,
                 ft: FaultTolerance | None = None, identity: Identity | None = None,
                 handlers: FenceHandlers | None = None) -> None:
        """`ft`: heartbeat_s, join_timeout_s (store connects and the join) and
        coordinator_wait_s."""
        ft, identity = ft or FaultTolerance(), identity or Identity()
        handlers = handlers or FenceHandlers()
        self.host, self.port = host, port
        self.token = identity.token  # None: no token; only proofs of it travel (session.py)
        self.fingerprint = identity.fingerprint
        self.join_at = identity.join_at
        self.refused: str | None = None  # the coordinator's reason, if it refused this process
        self.applied, self.last_generation = identity.applied, identity.last_generation
        # > 0: when the coordinator's connection closes (its process died), the caller waits
        # this long for a restarted one (`recover.Replica.reconnect`) instead of being fenced
        # for the silence; the watchdog still ends the process if the caller never takes over.
        self.restart_wait_s = ft.coordinator_wait_s
        self._floor = 0  # generations below this were published by an earlier coordinator
        # Admission mid-run (recover.Replica does the state transfer): `joining` until a
        # generation includes this replica; members learn of joiners in `join_requests`.
        self.joining = False
        self.run_over = False  # the coordinator said every member left (`over`): see RunOver
        self.join_epoch = -1
        # replica -> (epoch, first step it may join at): joiners waiting to be served (several
        # may wait at once: two replacements started close together)
        self.join_requests: dict[int, tuple[int, int]] = {}
        # The main thread's progress watchdog (`progress.ProgressWatch`): armed and told of
        # progress by the step protocol; overdue, the process fences itself (ExitCode.STUCK).
        self.watch = ProgressWatch()
        self._on_stuck = handlers.stuck or exit_stuck
        self._welcomed = threading.Event()  # the coordinator answered our hello
        self._bad_answer = False  # an answer without well-formed parameters was logged
        self._hb_paused = False
        self._admit_after = -1
        self.replica, self.rank, self.nranks = replica, rank, nranks
        # timeout_s bounds the store connects and the join
        self.heartbeat_s, self.timeout_s = ft.heartbeat_s, ft.join_timeout_s
        self._on_fenced = handlers.fenced or exit_fenced
        # None until the welcome: then FENCE_STALE_FACTOR x the coordinator's --stale-s.
        self.fence_after_s: float | None = None
        self._on_partitioned = handlers.partitioned or exit_partitioned
        self._heard = time.monotonic()  # last byte from the coordinator on the liveness socket
        # This host's address on its path to the coordinator (the liveness socket's local end),
        # and whether the coordinator is on another host: cross-replica traffic binds this
        # address unless the user names an interface (recover.collectives.comm).
        self.local_addr = ""
        self.live_port = 0  # the coordinator's liveness port, once connected
        self.shard_ports: list[int] = []  # its store shards' ports (control/shards.py)
        self.coordinator_remote = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._gen = -1
        self._members: dict[int, list[int]] = {}
        self._stop = threading.Event()
        self._waiters: set[threading.Event] = set()  # set whenever a generation is learned
        self.coordinator_lost = False
        # When a ping that carries the published generation was last heard (monotonic): while
        # they come, the periodic store read for a missed push is not needed (`_refresh_loop`).
        self._pinged = -REFRESH_S
        self.replicas = 0  # known after join()
        self.fenced = False  # set (for good) once a generation without this replica is seen
        # The protocol's requests of the main store are counted (the heartbeat carries the
        # total: the coordinator's `store_requests`); the communicator's rendezvous and gloo use
        # the plain client (control/storecount.py says why).
        self.plain_store = keys.connect_store(host, port, self.timeout_s)
        # The liveness session (control/session.py): set at the hello in a run with a token.
        self._session: session.Session | None = None
        self._send_lock = threading.Lock()
        self._rbuf = b""  # what came after the challenge line, for the reader
        self.requests = Tally()
        self.store = CountedStore(self.plain_store, self.requests, "main")

    # -- lifecycle -----------------------------------------------------------------------
    def join(self, timeout_s: float | None = None) -> int:
        """Connect the liveness socket, start heartbeats, wait for the first generation."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = Deadline(timeout_s)
        self._check_run(deadline)
        # The liveness address: needed before the hello, so read from the store, authentic
        # (sealed with the run's token) and well formed, or waited for (the coordinator puts
        # back one a stranger rewrote within 0.25 s). A wrong one could only cost the join: the
        # answer to the hello is sealed by a session only the token's holder can key.
        addr = keys.wait_value(self.store, self.token, keys.LIVENESS_ADDR, deadline,
                               f"coordinator did not publish {keys.LIVENESS_ADDR!r} in time",
                               valid=lambda v: _port_of(v) is not None) or b""
        lport = self.live_port = _port_of(addr) or 0
        # The background threads' store clients connect before the hello: the coordinator times
        # this member's silence from its hello, and a connect to a busy store server can take
        # tens of seconds (SYN retries when its accept queue is full, as when a large job's ranks
        # all connect at once: docs/MEASUREMENTS.md, "TCPStore").
        self._hb_store = self.store.clone()
        self._rd_store = self.store.clone()
        self._sock = socket.create_connection((self.host, lport), timeout=timeout_s)
        self.local_addr = self._sock.getsockname()[0]
        self.coordinator_remote = not is_loopback(self._sock.getpeername()[0])
        # Every read has a timeout; sends are a few bytes into an empty buffer and never wait.
        self._sock.settimeout(READ_TICK_S)
        self._heard = time.monotonic()
        # A replacement may ask not to be admitted before a step (the `restart` fault's step).
        words = ["hello", str(self.replica), str(self.rank), str(self.nranks), str(os.getpid()),
                 "-", self.fingerprint, str(max(0, int(self.join_at))), str(self.applied),
                 str(self.last_generation)]
        if self.token:  # the session (control/session.py)
            challenge = self._challenge(deadline)
            words[session.PROOF_AT] = session.hello_proof(self.token, challenge, words)
            self._session = session.Session(self.token, challenge, words[session.PROOF_AT], "m")
        self._sock.sendall((" ".join(words) + "\n").encode())
        for target, name in ((self._heartbeat_loop, "recover-heartbeat"),
                             (self._reader_loop, "recover-liveness"),
                             (self._watchdog_loop, "recover-watchdog"),
                             (self._refresh_loop, "recover-refresh")):
            threading.Thread(target=target, name=name, daemon=True).start()
        while True:
            with self._lock:
                if self._gen >= 0:  # learned after the welcome, which carried the parameters
                    return self._gen
            if self._welcomed.is_set() and not self.refused:
                self._refresh(self.store)  # after the answer: joining or not decides fencing
            if self.refused:
                raise CoordinatorLost(f"the coordinator refused this process: {self.refused}")
            if self.run_over:
                raise RunOver(f"replica {self.replica}: the run ended before it was admitted")
            if self.coordinator_lost:
                raise CoordinatorGone("the coordinator went away before training started")
            if self.store.check([keys.COORD_ERROR]):
                raise CoordinatorLost(self.store.get(keys.COORD_ERROR).decode())
            if deadline.passed():
                raise TimeoutError(f"no membership from the coordinator within {timeout_s:.0f}s")
            time.sleep(0.01)

    def connect_shard(self, index: int) -> Any | None:
        """A client of the coordinator's store shard `index` (control/shards.py), or None
        when it hosts none."""
        if not self.shard_ports:
            return None
        return keys.connect_store(self.host, self.shard_ports[index], self.timeout_s)

    def leave(self, reason: str = "") -> None:
        """Say goodbye (a clean exit is not a fault) and stop the background threads; `reason`
        (one word, e.g. "preempted") is what the coordinator records of the leave."""
        self._stop.set()
        try:
            # bye <main-store requests so far> [<reason>]: its last count, as a heartbeat
            # carries it, and why it leaves
            self._send(f"bye {self.requests.total('main')} {reason}".strip() + "\n",
                       raising=True)
            # shutdown() sends the FIN at once; a bare close() would not while the reader thread
            # is blocked in recv() on this socket, and the coordinator would see the rank go
            # silent (its heartbeat stale, stale_s later) instead of leaving cleanly.
            self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """Stop the background threads and close the liveness socket without a goodbye (the
        coordinator is gone; a restarted one is joined by a new Member)."""
        self._stop.set()
        sock = getattr(self, "_sock", None)  # None if join() failed before connecting
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def report_fail(self, generation: int, suspects: list[int] | tuple[int, ...] = ()) -> None:
        """Tell the coordinator a reduce of `generation` failed here (forces a rebuild), and
        whom this rank could not reach, if it knows (evidence: the coordinator evicts a member
        named by others, never the reporters)."""
        named = ",".join(str(r) for r in sorted(set(suspects))) or "-"
        self._send(f"fail {generation} {named}\n")

    def report_cut(self, generation: int, unreachable: list[int]) -> None:
        """This rank's data path cannot reach these members of `generation` (a handshake to
        each one's probe listener failed as a cut fails: `reach`): the coordinator evicts by
        this evidence (`admission.cut_off`)."""
        named = ",".join(str(r) for r in sorted(set(unreachable)))
        if named:
            self._send(f"cut {generation} {named}\n")

    def report_arrived(self, generation: int) -> None:
        """The members this rank named in `generation` arrived after all (or the op it waited
        in ended): withdraw it."""
        self._send(f"arrived {generation}\n")

    def report_waiting(self, generation: int) -> None:
        """This rank's op of `generation` has waited past `suspect_s` for someone it cannot
        name (a reduce names nobody): evidence against any member whose main thread stalls
        meanwhile for longer than WAIT_SLOWER x this rank's own last span between steps (the
        same work: `Membership.waiting`); withdrawn by `report_arrived` when the op ends."""
        self._send(f"wait {generation} {self.watch.between_s:.3f}\n")

    def report_ready(self, epoch: int) -> None:
        """A joiner's rank holds its verified state: admit it (`epoch` of the join)."""
        self._send(f"ready {epoch}\n")

    def report_donated(self, epoch: int, replica: int) -> None:
        """This rank streamed its state to the same rank of joining `replica` (join `epoch`),
        and the joiner acknowledged it verified: the coordinator admits a joiner only on its
        ranks' `ready` and its donors' word (a `ready` alone could be anyone's)."""
        self._send(f"donated {epoch} {replica}\n")

    def report_join_failed(self, epoch: int) -> None:
        """A joiner's rank could not get its state (its donor died): try another one."""
        self._send(f"joinfail {epoch}\n")

    # -- fault injection (in-process tests) --------------------------------------------------
    def stop_heartbeats(self) -> None:
        """Go silent like a stopped process, but keep reading pushes (a resumed process fences
        itself on the generation it missed)."""
        self._hb_paused = True

    def crash(self) -> None:
        """What a SIGKILL does to the outside world: silence, and the liveness socket closes."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()

    def tell(self, line: str) -> None:
        """Send one protocol line to the coordinator (a store shard's complete count,
        `shards.counted_line`): no store round trip; a lost connection shows as
        `coordinator_lost`, as for heartbeats."""
        self._send(line)

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
        deadline = Deadline(timeout_s)
        with self._changed:
            while self._gen <= generation:
                self.watch.progress()  # a legitimate wait, not a stuck thread
                if self.coordinator_lost:
                    raise CoordinatorLost("the coordinator is unreachable")
                left = deadline.left()
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
    def _send(self, msg: str, raising: bool = False) -> None:
        """One or more lines to the coordinator, sealed in a session: the lock keeps the wire's
        order the order they were numbered in (several threads send)."""
        try:
            with self._send_lock:
                if self._session is not None:
                    msg = self._session.seal(msg)
                self._sock.sendall(msg.encode())
        except TimeoutError:
            pass  # a full buffer: the link is silent, and the watchdog decides about silence
        except OSError:
            if raising:  # the caller handles it (`leave`: the coordinator is gone anyway)
                raise
            self.coordinator_lost = True

    def _check_run(self, deadline: Deadline) -> None:
        """Stop here, as a refusal, unless the coordinator holds this process's token (its
        `coord/run` proves it; "-" for none): a worker of another run (or without the run's
        token) could read none of the run's sealed values, and must not wait for them. A value a
        stranger rewrote is put back within the coordinator's REASSERT_S (0.25 s): a mismatch is
        waited past for three of those."""
        want = proof(self.token, keys.RUN_PURPOSE).encode()
        until = deadline.sooner(Deadline(0.75))

        def proven() -> bool:
            got = keys.try_get(self.store, keys.RUN_PROOF)
            if got is not None and hmac.compare_digest(got, want):
                return True
            if got is not None and until.passed():
                self.refused = ("wrong run token (the coordinator proves another token: another "
                                "run's, or RECOVER_RUN_TOKEN is not this run's)")
                raise CoordinatorLost(f"the coordinator refused this process: {self.refused}")
            return False

        wait_until(proven, deadline, 0.01,
                   f"coordinator did not publish {keys.RUN_PROOF!r} in time")

    def _challenge(self, deadline: Deadline) -> str:
        """The coordinator's challenge: the first line it sends a connection, with a token."""
        buf = b""
        while b"\n" not in buf:
            if deadline.passed() or len(buf) > 4096:
                raise TimeoutError("no challenge from the coordinator in time")
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            if not data:
                raise CoordinatorGone("the coordinator closed the connection before its challenge")
            buf += data
        line, self._rbuf = buf.split(b"\n", 1)
        words = line.decode(errors="replace").split()
        if len(words) != 2 or words[0] != "challenge" or len(words[1]) != session.NONCE_HEX:
            raise CoordinatorLost(f"not a challenge from the coordinator: {line[:100]!r}")
        return words[1]

    def _refresh(self, store, upto: int | None = None) -> None:
        """Learn every generation published so far from the store (count is bumped after the
        members are set), or, told of `upto` by a push, every one up to it (its members were
        set before the push)."""
        if not self._welcomed.is_set():
            return  # until the coordinator answered our hello, we do not know if we are joining
        count = keys.store_int(store, keys.GEN_COUNT) if upto is None else upto + 1
        with self._lock:
            known = self._gen
        for g in range(max(known + 1, self._floor), count):
            members = keys.generation_members(store, g, self.token)
            if members is None or not self._learn(g, members):
                return

    def _learn(self, g: int, members: list[int]) -> bool:
        """Make generation g known here (once); False if it fenced this process."""
        if self.joining and self.replica in members and g > self._admit_after:
            self.joining = False  # admitted: from now on a generation without us fences us
        for r in [r for r in list(self.join_requests) if r in members]:
            self.join_requests.pop(r, None)
        fenced = self.replica not in members and not self.joining
        if fenced:
            # Fence before the generation becomes visible: no thread of this process may
            # ever act in (or even see) a generation without its replica.
            self.fenced = True
            self._on_fenced(f"replica {self.replica} (pid {os.getpid()}) is not a member of "
                            f"generation {g} (members {members}): fenced, exiting")
        with self._changed:
            if g not in self._members:  # the other background thread may have got here first
                self._members[g] = members
                self._gen = max(self._gen, g)
                self._changed.notify_all()
                for ev in self._waiters:
                    ev.set()
        return not fenced  # a custom on_fenced returned: comm refuses to reduce from now on

    def _heartbeat_loop(self) -> None:
        # Heartbeats are a line on the liveness socket: the coordinator reads them with its
        # selector (work per event, nothing per rank per period), and no store round trip is
        # spent on them: a store that stalls (for seconds on a loaded host: docs/MEASUREMENTS.md,
        # "Liveness and detection") must not silence a live process.
        while not self._stop.is_set():
            if not self._hb_paused:
                # hb <seconds stalled> <main-store requests so far>
                self._send(f"hb {self.watch.stalled_s():.2f} {self.requests.total('main')}\n")
            self._stop.wait(self.heartbeat_s)

    def _refresh_loop(self) -> None:
        """The slow fallback for a missed push: read the generations from the store every 2 s,
        on its own thread and store client (a store call may block while the store stalls),
        unless pings that carry the generation have been heard meanwhile (they tell of a
        missed push sooner, for no request while none was missed)."""
        while not self._stop.wait(REFRESH_S):
            if time.monotonic() - self._pinged < REFRESH_S:
                continue  # the pings tell of every generation (`_pushed`): no store request
            try:
                self._refresh(self._hb_store)
            except Exception:
                if self._stop.is_set():
                    return
                self.coordinator_lost = True
                with self._changed:
                    self._changed.notify_all()
                return

    def _reader_loop(self) -> None:
        buf, self._rbuf = self._rbuf, b""
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue  # silence is the watchdog's business
            except OSError:
                data = b""
            if not data:
                if not self._stop.is_set():
                    self.coordinator_lost = True
                    with self._changed:
                        self._changed.notify_all()
                return
            self._heard = time.monotonic()
            buf += data
            if b"\n" in buf:
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if self._session is not None:
                        opened = self._session.open(line)
                        # Before the answer to our hello, a refusal comes bare (our proof did
                        # not verify there: no key to seal it with).
                        if opened is None and not (line.startswith(b"refused") and
                                                   not self._welcomed.is_set()):
                            sealed.rejected("liveness", "a line not sealed for this session")
                            continue
                        line = line if opened is None else opened
                    upto = self._pushed(line.decode(errors="replace").split())
                    if upto is None:
                        continue  # pings and join notes, or a generation the push carried
                    try:
                        self._refresh(self._rd_store, upto)
                    except Exception:
                        pass  # the heartbeat thread notices a dead store

    def _pushed(self, words: list[str]) -> int | None:
        """Handle one line from the coordinator; a generation to read from the store up to, if
        it told of one it did not carry (or this process did not know the one it changed)."""
        try:
            if words[:1] == ["gen"]:
                with self._lock:
                    g, members = keys.read_gen_push(words, self._members)
                if members is None or not self._welcomed.is_set():
                    return g
                self._learn(g, members)
            elif words[:1] == ["ping"] and len(words) > 1:  # ping <generation published last>
                self._pinged = time.monotonic()
                with self._lock:
                    behind = int(words[1]) > self._gen
                if behind and self._welcomed.is_set():
                    return int(words[1])  # its push was lost: read it from the store
            elif words[:1] == ["welcome"]:  # welcome <floor> <params>: Membership.params
                if self._take_params(words[2:]):
                    self._floor = int(words[1])
                    self._welcomed.set()
            elif words[:1] == ["join"]:  # join <replica> <epoch> <step>: a joiner waits for a donor
                self.join_requests[int(words[1])] = (int(words[2]), int(words[3]))
            elif words[:1] == ["joinend"]:  # joinend <epoch>: admitted or given up
                for r, (epoch, _) in list(self.join_requests.items()):
                    if epoch == int(words[1]):
                        self.join_requests.pop(r, None)
            elif words[:1] == ["joining"]:  # joining <epoch> <generation now> <floor> <params>
                # We are the joiner. Generations up to now may hold our earlier incarnation:
                # only a later one that includes us admits us.
                if self._take_params(words[4:]):
                    self._admit_after = int(words[2])
                    self._floor = int(words[3])
                    self.joining, self.join_epoch = True, int(words[1])
                    self._welcomed.set()
            elif words[:1] == ["over"]:  # every member left: nothing is left to join
                self.run_over = True
                self._welcomed.set()
            elif words[:1] == ["refused"]:
                self.refused = " ".join(words[1:]) or "refused"
                self.coordinator_lost = True
                self._welcomed.set()
        except (ValueError, IndexError):
            pass
        return None

    def _take_params(self, words: list[str]) -> bool:
        """Take the coordinator's parameters from its answer to our hello (`<stale_s>
        <replicas> <shard ports or ->`: `Membership.params`); False (logged, the answer ignored)
        when they are not well formed."""
        got = _params_of(words)
        if got is None:
            if not self._bad_answer:  # once: only the coordinator's sealed answer gets here
                log.warning("ignored an answer to the hello without well-formed parameters: "
                            "%r", " ".join(words)[:80])
            self._bad_answer = True
            return False
        stale, self.replicas, self.shard_ports = got
        self.fence_after_s = FENCE_STALE_FACTOR * stale
        return True

    def _watchdog_loop(self) -> None:
        """Fence this process once the coordinator has been silent for `fence_after_s`.

        Touches neither the store nor the socket's data, so no partition can block it. Bytes
        waiting unread mean the coordinator did talk and this process was stopped or starved
        (SIGSTOP, load): the reader gets one more bound to handle them (and to fence on a newer
        generation) before this fences anyway (the reader may be stuck in a store call).
        """
        unread_since: float | None = None
        while not self._stop.wait(READ_TICK_S):
            # Until the welcome brings --stale-s, a default bound (the join has its own).
            bound = float(self.fence_after_s or FENCE_STALE_FACTOR * 2.0)
            now = time.monotonic()
            overdue = self.watch.overdue(now)
            if overdue is not None:
                self.fenced = True
                self._on_stuck(f"replica {self.replica} rank {self.rank} (pid {os.getpid()}): "
                               f"its main thread made no progress in the step protocol for "
                               f"{overdue[0]:.1f}s (bound {overdue[1]:.1f}s): "
                               f"stuck (a deadlock or a hung kernel); exiting with code "
                               f"{int(ExitCode.STUCK)} so the others can go on")
                return
            silent = now - self._heard
            died = self.coordinator_lost and self.restart_wait_s > 0
            # A closed connection (the coordinator's process died) is not a partition of ours:
            # the caller waits for a restarted coordinator; fence only if it never takes over.
            limit = bound + (self.restart_wait_s + bound if died else 0.0)
            if silent <= limit:
                unread_since = None
                continue
            try:
                unread = not died and _readable(self._sock)
            except (OSError, ValueError):  # closed by leave()
                return
            if unread:
                unread_since = unread_since or now
            if (unread and now - unread_since <= bound) or self._stop.is_set() \
                    or time.monotonic() - self._heard <= limit:
                continue
            self.fenced = True  # comm refuses to reduce from now on, if on_partitioned returns
            self._on_partitioned(
                f"replica {self.replica} rank {self.rank} (pid {os.getpid()}) heard nothing from "
                f"the coordinator at {self.host}:{self.port} for {silent:.1f}s (bound "
                f"{bound:.1f}s = {FENCE_STALE_FACTOR:g} x its --stale-s): cut off (a network "
                f"partition, or the coordinator's host is down); the others have dropped it. "
                f"Exiting with code {int(ExitCode.PARTITIONED)} without touching shared state")
            return


def _readable(sock: socket.socket) -> bool:
    # poll, not select: select refuses a descriptor >= 1024 (a rank with many connections)
    p = select.poll()
    p.register(sock, select.POLLIN)  # ValueError once closed (its fileno is -1)
    return bool(p.poll(0))


def exit_fenced(why: str) -> None:
    """The default `FenceHandlers.fenced`: log why, exit with `ExitCode.FENCED` at once."""
    _exit_with(ExitCode.FENCED, why)


def exit_partitioned(why: str) -> None:
    """The default `FenceHandlers.partitioned`: log why, exit with `ExitCode.PARTITIONED`."""
    _exit_with(ExitCode.PARTITIONED, why)


def exit_stuck(why: str) -> None:
    """The default `FenceHandlers.stuck`: log why, exit with `ExitCode.STUCK`."""
    _exit_with(ExitCode.STUCK, why)


def _exit_with(code: ExitCode, why: str) -> None:
    # os._exit: no thread of this process may act again, and teardown could block on a dead
    # peer; logging's stream handlers flush each record, so the reason is written first.
    log.error("%s", why)
    os._exit(int(code))


# What a member accepts of the coordinator's parameters (anything else is a stranger's: absent).
def _port_of(addr: bytes) -> int | None:
    """The port of a `host:port` liveness address; None when it is not one."""
    host, sep, port = addr.decode(errors="replace").rpartition(":")
    return int(port) if sep and host and port.isdigit() and 0 < int(port) < 65536 else None


def _params_of(words: list[str]) -> tuple[float, int, list[int]] | None:
    """(stale_s, replicas, shard ports) from a welcome's parameters; None when malformed."""
    if len(words) != 3 or not _stale_of(words[0].encode()) or \
            not _replicas_of(words[1].encode()):
        return None
    ports = [] if words[2] == "-" else shards.parse_ports(f"[{words[2]}]".encode())
    if ports is None:
        return None
    return float(words[0]), int(words[1]), ports


def _replicas_of(raw: bytes) -> bool:
    return raw.isdigit() and 0 < int(raw) <= MAX_REPLICAS


def _stale_of(raw: bytes) -> bool:
    try:
        stale = float(raw)
    except ValueError:
        return False
    return math.isfinite(stale) and 0 < stale <= 86400
