"""The coordinator's membership state machine: generations, evidence, joins, resume and exits.

It holds no socket: the transport (`recover.control.liveness`) hands it what each accepted
liveness connection said, as calls, and it answers through a `Wire` (send to one connection, or to
every one) and the store; so each decision can be driven and checked without a network.

Invariants:
- It is the only writer of generations. Generation g+1's members are generation g's members minus
  every replica with evidence of loss (its connection closed without a goodbye, it went silent for
  stale_s, one of its ranks reported it lost, or other members name it and the evidence convicts
  it: `admission.convicted`), plus a replica admitted after its state transfer; it is written once
  (compare-and-set) and then pushed to every connection, and never changed.
- Only an accepted hello (valid ids, the run's token, the run's config fingerprint, not a
  duplicate: `admission.refusal`) makes a connection a `Peer`, and a peer speaks only for its own
  replica.
- A data-path cut a member reports (`cut`: its handshake to another member failed as a cut
  fails) evicts the members `admission.cut_off` picks, so the rest reach each other: decided
  `stale_s` / 2 after the generation's first cut report (the others' probes, which ran at the
  same time, come in meanwhile), then at each later report; never both of two that name each
  other, and never on the word of a member already being evicted.
- A member is evicted on others' naming only when `admission.convicted` convicts it (its main
  thread stalled, or it reaches nobody); a naming its reporter withdraws (`arrived`) stands no
  more; naming that neither convicts nor is withdrawn rebuilds the same members after 2 x stale_s.
  A member whose op waits past suspect_s for someone it cannot name (`wait`: a reduce) names
  every member whose main thread stalls meanwhile for over WAIT_SLOWER x the waiter's own last
  span between steps, until it withdraws (`arrived`).
- A joiner becomes a member only in a new generation published after every one of its ranks
  reported a verified state from a donor (`ready`) and, for every one of them, a rank of a member
  confirmed it donated that state and the joiner acknowledged it (`donated`): a `ready` alone,
  even a token holder's, admits nobody. A join given up publishes a generation too, so whoever
  paused a step for it goes on.
- The answer to a hello that lets it in (`welcome`, `joining`) carries the coordinator's
  parameters (`params`): a member takes them from there, sealed by its session, not the store.
- A restarted coordinator (`recover`) publishes its first generation only from what the
  re-registered replicas hold (`admission.resume_plan`): the run resumes at the highest step a
  replica holds whole, numbered after every generation any rank knew; every other replica is
  healed by a state transfer before it is a member again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from recover.control import keys, sealed
from recover.control.admission import (
    Hello,
    Join,
    Registration,
    convicted,
    cut_off,
    refusal,
    resume_plan,
)
from recover.control.coordconfig import CoordinatorConfig

log = logging.getLogger(__name__)
DEBOUNCE_S = 0.02  # collect simultaneous failures into one generation
# Generations whose members the coordinator keeps in the store against a rewrite: a member (or a
# joiner) reads at most the one before the newest it is told of (a push names its base).
RECENT_GENERATIONS = 4
# A member others wait for is evicted once its main thread has stalled this many times as long as
# they spent between their last two steps (`waiting`): a deadlock, not a straggler at the same work.
WAIT_SLOWER = 3.0
# The words a replica's end is written in (its `evidence` reason, its entry in the exits): readers
# (recover.app.status, the launcher, the bench) match these, never copies of them.
LEFT_CLEANLY = "left cleanly"  # it said goodbye: no fault
CONNECTION_CLOSED = "connection closed"  # its connection closed without a goodbye
LOST = "lost"  # an exit: it ended without a goodbye
FENCED = "fenced"  # an exit: dropped while its connection was open (silent, cut off)


def clean_leave(bye_reason: str) -> str:
    """The reason (and the exit) of a replica that said goodbye, with the word it gave
    ("left cleanly (preempted)"; "left cleanly": the run ended)."""
    return f"{LEFT_CLEANLY} ({bye_reason})" if bye_reason else LEFT_CLEANLY


class Wire(Protocol):
    """How the membership talks to its connections (the transport's sockets, or a test's list)."""

    def send(self, conn: int, msg: str) -> None: ...

    def send_all(self, msg: str) -> None:
        """To every connection, accepted or not."""


@dataclass
class Peer:
    """An accepted liveness connection: whose it is, and what it said of itself."""

    replica: int
    rank: int
    nranks: int
    pid: int
    said_bye: bool = False
    bye_reason: str = ""  # why it left cleanly, as it said ("preempted"; "": the run ended)
    stalled_s: float = 0.0  # its last heartbeat: how long its main thread has stalled (0: not)

    @property
    def stalled(self) -> bool:
        return self.stalled_s > 0


class Membership:
    """The membership of one run as the coordinator decides it (see the module docstring).

    `store`: the coordinator's store client (set, compare_set, add); `log`: one event record.
    Connections are named by the transport's ids (`conn`)."""

    def __init__(self, config: CoordinatorConfig, store: Any, wire: Wire,
                 log: Callable[[dict], None] = lambda rec: None,
                 started: float | None = None) -> None:
        self.expected, self.stale_s = config.replicas, config.stale_s
        self.join_timeout_s, self.recover = config.join_timeout_s, config.recover
        # A member must show the run's token (when set) and the fingerprint of the run's
        # trajectory-defining config (when set; else the first member's sets it): docs/DESIGN.md,
        # "Checkpoints, rejoin and trust".
        self.token, self.fingerprint = config.token, config.fingerprint
        self.store, self.wire, self.log = store, wire, log
        self.started = time.monotonic() if started is None else started
        self.peers: dict[int, Peer] = {}  # conn -> its accepted hello
        self.generation = -1
        self.members: list[int] = []
        # The newest generations' members as stored (sealed): put back if rewritten.
        self.recent_members: dict[str, bytes] = {}
        self.member_since: dict[int, int] = {}  # member -> the generation that admitted it
        self.replicas: dict[int, Registration] = {}
        self.joins: dict[int, Join] = {}  # replica -> its admission in progress
        self.epochs = 0
        self.lost: dict[int, str] = {}  # replica -> reason, not yet published
        self.pending_since: float | None = None
        self.accusations: dict[int, set[int]] = {}  # accused -> accusers, this generation
        # connection -> its rank's span between steps, while its op waits for someone (`waiting`)
        self.waiters: dict[int, float] = {}
        self.accused_since: float | None = None
        self.cuts: dict[int, set[int]] = {}  # reporter -> whom its data path cannot reach
        self.cut_reporters: list[int] = []  # in the order their first cut report came
        self.cut_since: float | None = None  # this generation's first cut report
        self.exits: dict[int, str] = {}  # replica -> how it ended, as seen from here
        self.all_left = False
        # recover: the replicas that kept running re-register with the steps they applied; the
        # first generation resumes the run (`_resume`), numbered after every generation they knew.
        self.resume: dict[int, dict[int, int]] = {}  # replica -> rank -> steps applied
        self.newest_seen = -1  # the newest generation any re-registering rank knew
        self.join_at: dict[int, int] = {}  # replica -> the step it asked to join at, if any
        self.last_hello = 0.0
        self.floor = 0  # this coordinator's first generation (older ones are not in its store)
        self.gen_count = 0  # the store's GEN_COUNT
        self.published: int | None = None  # the last generation this coordinator published
        self._exits_due = False  # the exits changed; written with the pending publication
        self.shard_ports: list[int] = []  # the coordinator's store shards (set by its transport)

    # -- what a connection says ------------------------------------------------------------------
    def hello(self, conn: int, h: Hello) -> bool:
        """An accepted hello makes `conn` a peer (True); a refused one is answered (False: the
        transport drops the connection)."""
        known = self.replicas.get(h.replica) or self.joins.get(h.replica)
        why = refusal(h, self.expected, self.token, self.fingerprint,
                      any(p.replica == h.replica and p.rank == h.rank
                          for p in self.peers.values()),
                      known.nranks if known is not None and h.replica in self.members else None)
        if why is not None:
            self.wire.send(conn, f"refused {why}\n")
            self.log({"event": "refused", "replica": h.replica, "rank": h.rank, "pid": h.pid,
                      "why": why})
            return False
        replica, rank, nranks = h.replica, h.rank, h.nranks
        if self.fingerprint in (None, "-") and h.fingerprint != "-":
            self.fingerprint = h.fingerprint  # the first member's config defines the run
        self.peers[conn] = Peer(replica, rank, nranks, h.pid)
        self.log({"event": "hello", "replica": replica, "rank": rank, "pid": h.pid})
        if self.generation < 0 and self.recover:
            # Answered once the resume point is decided: welcome, or heal by state transfer.
            self.replicas.setdefault(replica, Registration(nranks)).ranks.add(rank)
            self.resume.setdefault(replica, {})[rank] = h.applied
            self.join_at[replica] = max(self.join_at.get(replica, 0), h.join_at)
            self.newest_seen = max(self.newest_seen, h.generation)
            self.last_hello = time.monotonic()
            return True
        if self.generation < 0 or (replica in self.members and replica not in self.lost):
            self.replicas.setdefault(replica, Registration(nranks)).ranks.add(rank)
            self.wire.send(conn, f"welcome {self.floor} {self.params()}\n")
            return True
        if self.all_left:
            # A replacement that says hello after every member left (`everyone_left`) has
            # nothing to join: told so at once, not left waiting to be killed.
            self.wire.send(conn, "over\n")
            return True
        # Mid-run: admission at a step boundary, after a live state transfer (docs/DESIGN.md,
        # "Checkpoints, rejoin and trust"). A replacement whose predecessor's loss is not yet
        # published joins too (announced with that generation, `_publish`): welcomed before it,
        # it would take itself for the member the survivors are dropping, and be fenced at once.
        join = self.joins.setdefault(replica, Join(nranks))
        join.ranks.add(rank)
        join.at = max(join.at, h.join_at)
        self._set_exit(replica, "joining")
        if len(join.ranks) == join.nranks and join.epoch < 0 and replica not in self.members:
            self._announce_join(replica, join)
        elif join.epoch >= 0:
            self.wire.send(conn, f"joining {join.epoch} {self.generation} {self.floor} "
                                 f"{self.params()}\n")
        return True

    def heartbeat(self, conn: int, stalled_s: float) -> None:
        """`hb [<seconds stalled>]`: how long its main thread has stalled in the step protocol
        (0: it has not, or not past its report bound)."""
        peer = self.peers[conn]
        was, peer.stalled_s = peer.stalled, stalled_s
        if peer.stalled and ((not was and self.accusations) or self.waiters):
            self._judge()  # a named or awaited member's main thread stalls: it may convict

    def failed(self, conn: int, generation: int, suspects: list[int]) -> None:
        """`fail <generation> [suspects]`: a reduce failed there; rebuild, or weigh whom it
        names."""
        replica = self.peers[conn].replica
        if generation == self.generation and replica in self.members:
            self._evidence(replica, suspects)

    def cut(self, conn: int, generation: int, unreachable: list[int]) -> None:
        """`cut <generation> <r1,...>`: this rank's data path cannot reach them; evict whom
        `admission.cut_off` picks (docs/DESIGN.md, "Membership and faults")."""
        reporter = self.peers[conn].replica
        if generation != self.generation or reporter not in self.members or reporter in self.lost:
            return  # an older generation's, or the word of a member already being evicted
        named = {r for r in unreachable if r != reporter and r in self.members}
        if not named:
            return
        if reporter not in self.cuts:
            self.cut_reporters.append(reporter)
        self.cuts.setdefault(reporter, set()).update(named)
        self.log({"event": "cut", "replica": reporter, "unreachable": sorted(named)})
        self.cut_since = self.cut_since or time.monotonic()
        self.check_timeouts(time.monotonic())

    def _decide_cuts(self) -> None:
        for r in cut_off(self.cuts, self.cut_reporters, self.members, set(self.lost),
                         self.member_since):
            self._mark_lost(r, self._cut_reason(r))

    def _cut_reason(self, r: int) -> str:
        """Why `cut_off` evicted r, for the generation's reason and r's exit record."""
        by = sorted({a for a, n in self.cuts.items() if r in n} | self.cuts.get(r, set()))
        # One accuser only when the two tied (`cut_off`): the first reporter stayed.
        newer = len(by) == 1 and self.member_since.get(r, 0) > self.member_since.get(by[0], 0)
        why = ("it was admitted later" if newer else f"replica {by[0]} reported first"
               if len(by) == 1 else "the others reach each other without it")
        return (f"unreachable from replica{'s' if len(by) > 1 else ''} "
                f"{', '.join(map(str, by))} over the data path (a cut; {why})")

    def arrived(self, conn: int, generation: int) -> None:
        """`arrived <generation>`: whom this rank named caught up (or the op it waited in
        ended); its naming is withdrawn."""
        if generation == self.generation:
            self.waiters.pop(conn, None)
            self._withdraw(self.peers[conn].replica)

    def waiting(self, conn: int, generation: int, between_s: float) -> None:
        """`wait <generation> <span>`: this rank's op has waited past suspect_s for someone it
        cannot name; `span`, its own last time between two steps. Evidence, until the op ends,
        against every other member whose main thread stalls for longer than WAIT_SLOWER x that
        span (`_judge`): a deadlock, not a member only slower at the same work (an evaluation)."""
        replica = self.peers[conn].replica
        if generation == self.generation and replica in self.members:
            self.waiters[conn] = between_s
            self._judge()

    def reported_lost(self, conn: int, reason: str) -> None:
        """`lost <reason>`: one of this replica's ranks died."""
        self._mark_lost(self.peers[conn].replica, "reported lost: " + reason[:200])

    def bye(self, conn: int, reason: str = "") -> None:
        """`bye [reason]`: the rank leaves cleanly (a leave, not a loss), for `reason`."""
        self.peers[conn].said_bye = True
        self.peers[conn].bye_reason = reason[:40]

    def params(self) -> str:
        """What a member needs of this coordinator, as the last words of its `welcome` or
        `joining`: `<stale_s> <replicas> <shard ports, comma-separated, or ->`."""
        ports = ",".join(str(p) for p in self.shard_ports) or "-"
        return f"{self.stale_s!r} {self.expected} {ports}"

    def ready(self, conn: int, epoch: int) -> None:
        """`ready <epoch>`: a joiner's rank holds its verified state."""
        peer = self.peers[conn]
        join = self.joins.get(peer.replica)
        if join is None or join.epoch != epoch:
            return
        join.ready.add(peer.rank)
        self._admit(peer.replica, join)

    def donated(self, conn: int, epoch: int, replica: int) -> None:
        """`donated <epoch> <replica>`: this member's rank streamed its state to the same rank
        of joining `replica`, which verified and acknowledged it (`rejoin.serve`). Only a
        member's word counts (not the joiner's own, nor one being evicted)."""
        peer = self.peers[conn]
        join = self.joins.get(replica)
        if (join is None or join.epoch != epoch or peer.replica == replica
                or peer.replica not in self.members or peer.replica in self.lost):
            return
        join.donated.add(peer.rank)
        self._admit(replica, join)

    def _admit(self, replica: int, join: Join) -> None:
        """Admit `replica` once every rank said `ready` and a donor confirmed each one."""
        whole = set(range(join.nranks))
        if join.ready >= whole and join.donated >= whole:
            epoch = join.epoch
            del self.joins[replica]
            self.replicas[replica] = Registration(join.nranks, set(join.ranks))
            self._set_exit(replica, "running")
            self._publish(sorted({*self.members} - set(self.lost) | {replica}),
                          f"replica {replica} admitted (join {epoch})")
            self._end_join(epoch)

    def donor_gone(self, conn: int, epoch: int) -> None:
        """`joinfail <epoch>`: a joiner's donor went away; try another."""
        self._join_failed(self.peers[conn].replica, epoch, "its donor went away")

    def closed(self, conn: int) -> None:
        """The connection closed (the transport has dropped it)."""
        peer = self.peers.pop(conn, None)
        self.waiters.pop(conn, None)  # fds are reused: a new connection must not inherit it
        if peer is None:
            return
        join = self.joins.get(peer.replica)
        if join is not None and peer.replica not in self.members:
            join.ranks.discard(peer.rank)
            if join.epoch >= 0:  # whoever paused a step for it goes on (a new generation)
                self._join_failed(peer.replica, join.epoch, "the joiner went away")
            if self._gone(peer.replica):
                self.joins.pop(peer.replica, None)
                self._set_exit(peer.replica, f"{LOST} while joining (pid {peer.pid})")
            return
        if peer.said_bye:
            # A clean exit is not a fault, but the others must stop counting on it: the next
            # generation leaves it out (at the end of training nobody is waiting any more).
            if peer.replica in self.members and self._gone(peer.replica):
                how = clean_leave(peer.bye_reason)
                self._mark_lost(peer.replica, how)  # first: the exit then goes with the
                self._set_exit(peer.replica, how)  # publication (`_write_exits`)
            return
        why = f"{CONNECTION_CLOSED} (pid {peer.pid} rank {peer.rank})"
        newly = peer.replica in self.members and peer.replica not in self.lost
        self._mark_lost(peer.replica, why)
        if newly:
            self._set_exit(peer.replica, f"{LOST}: {why}")

    def silent(self, conn: int, seconds: float) -> None:
        """The transport heard nothing on `conn` for `seconds` > stale_s."""
        peer = self.peers.get(conn)
        if peer is not None and peer.replica in self.members and peer.replica not in self.lost:
            self._mark_lost(peer.replica, f"silent for {seconds:.2f}s (rank {peer.rank})")

    # -- what time decides -----------------------------------------------------------------------
    def check_timeouts(self, now: float) -> None:
        """Cut reports are decided once their window passed; naming that convicted nobody for
        2 x stale_s rebuilds; a join without state in time is given up."""
        if self.cut_since is not None and now - self.cut_since >= self.stale_s / 2:
            self._decide_cuts()
        if self.accused_since and now - self.accused_since > 2 * self.stale_s:
            self.accused_since = None
            self._mark_lost(None, "failed reduces named no member conclusively")
        for replica, join in list(self.joins.items()):
            if join.epoch >= 0 and now - join.since > self.join_timeout_s:
                self._join_failed(replica, join.epoch, f"no state within {self.join_timeout_s}s")

    def publish_due(self, now: float) -> bool:
        """Evidence waited DEBOUNCE_S (simultaneous failures make one generation)."""
        return self.pending_since is not None and now - self.pending_since >= DEBOUNCE_S

    def publish_next(self) -> None:
        members = [m for m in self.members if m not in self.lost]
        reason = "; ".join(f"replica {r}: {why}" for r, why in sorted(self.lost.items()))
        self._publish(members, reason or "rebuild after a failed reduce")

    def everyone_left(self) -> bool:
        """True once (and logged), when no member is left and no member's connection is open.
        A dropped member cut off by a partition keeps its connection open (no FIN arrives) until
        the link returns: only members' connections count here."""
        member_conns = any(p.replica in self.members for p in self.peers.values())
        if self.members or member_conns or self.all_left:
            return False
        self.all_left = True
        self.log({"event": "all-left"})
        # Whoever still waits to be admitted (a replacement started near the end) would wait for
        # its join timeout or be killed: the run is over, and it can leave at once.
        for conn in list(self.peers):
            self.wire.send(conn, "over\n")
        return True

    def first_generation(self, now: float) -> bool:
        """Publish the first generation once every replica joined (or the join timeout passed
        with some); True if it did, so silence is judged from now on."""
        if self.recover:
            return self._resume_run(now)
        complete = sorted(r for r, rep in self.replicas.items() if len(rep.ranks) >= rep.nranks)
        timed_out = now - self.started > self.join_timeout_s
        if len(complete) >= self.expected or (timed_out and complete):
            self._publish(complete, "initial membership")
            self.exits.update({r: "running" for r in complete})
            self._write_exits()
            return True
        if timed_out:
            self.store.set(keys.COORD_ERROR, f"no replica joined within {self.join_timeout_s}s")
            self.log({"event": "join-timeout"})
            self.generation = 0
            self.members = []
        return False

    # -- evidence --------------------------------------------------------------------------------
    def _gone(self, replica: int) -> bool:
        return not any(p.replica == replica for p in self.peers.values())

    def _mark_lost(self, replica: int | None, reason: str) -> None:
        if replica is not None:
            if self.generation < 0:
                self.replicas.pop(replica, None)  # died before the first generation
                self._set_exit(replica, f"{LOST} before the start: {reason}")
                self.log({"event": "lost-before-start", "replica": replica, "reason": reason})
                return
            if replica not in self.members or replica in self.lost:
                return
            self.lost[replica] = reason
            # Dropped while its connection is still open (silent: hung or cut off), it must
            # fence itself; otherwise the caller already said how it ended.
            if not self._gone(replica):
                self._set_exit(replica, f"{FENCED}: {reason}", keep=True)
        self.log({"event": "evidence", "replica": replica, "reason": reason})
        if self.pending_since is None:
            self.pending_since = time.monotonic()

    def _evidence(self, reporter: int, suspects: list[int]) -> None:
        """A failed reduce, or members missing at a barrier: rebuild, or evict whom the evidence
        convicts (`admission.convicted`: a stalled member others name; a partitioned member that
        names everyone while everyone names it)."""
        for s_ in suspects:
            if s_ != reporter and s_ in self.members:
                self.accusations.setdefault(s_, set()).add(reporter)
        if self._judge():
            return
        if suspects:
            # Not conclusive (late members may be slow, not lost): a member that stalls is
            # convicted as its heartbeat says so (`_judge`), one that arrives is withdrawn
            # (`arrived`); after 2 x stale_s with neither, rebuild anyway.
            self.accused_since = self.accused_since or time.monotonic()
        else:
            self._mark_lost(None, f"reduce failed at replica {reporter}")

    def _judge(self) -> bool:
        """Evict every member the standing evidence convicts; True if any."""
        stalled_for: dict[int, float] = {}  # replica -> its ranks' longest stall
        for p in self.peers.values():
            if p.stalled and p.replica in self.members:
                stalled_for[p.replica] = max(stalled_for.get(p.replica, 0.0), p.stalled_s)
        stalled = set(stalled_for)
        # A member others wait for in an op that names nobody stands accused by them, but only
        # once it is stalled itself, and WAIT_SLOWER times longer than they took between steps:
        # a late member is not evicted for being late.
        accusations = {r: set(a) for r, a in self.accusations.items()}
        for r, age in stalled_for.items():
            by = {self.peers[c].replica for c, span in self.waiters.items()
                  if c in self.peers and age > WAIT_SLOWER * span} - {r}
            if by:
                accusations.setdefault(r, set()).update(by)
        guilty = convicted(accusations, self.members, stalled)
        for r in guilty:
            by = sorted(accusations[r])
            self._mark_lost(r, f"its main thread stalled while replica(s) {by} waited for it"
                            if r in stalled else
                            f"unreachable, named by replica(s) {by} (it reaches nobody)")
        return bool(guilty)

    def _withdraw(self, reporter: int) -> None:
        """The members `reporter` named have arrived at its barrier: its accusations stand no
        more (nothing is rebuilt for a member that was only late)."""
        for accused in list(self.accusations):
            self.accusations[accused].discard(reporter)
            if not self.accusations[accused]:
                del self.accusations[accused]
        if not self.accusations:
            self.accused_since = None

    # -- joins -----------------------------------------------------------------------------------
    def _announce_join(self, replica: int, join: Join) -> None:
        self.epochs += 1
        join.epoch, join.ready, join.since = self.epochs, set(), time.monotonic()
        join.donated = set()
        self.log({"event": "join", "replica": replica, "epoch": join.epoch})
        for conn, p in list(self.peers.items()):
            if p.replica == replica:
                self.wire.send(conn, f"joining {join.epoch} {self.generation} {self.floor} "
                                     f"{self.params()}\n")
            elif p.replica in self.members:
                self.wire.send(conn, f"join {replica} {join.epoch} {join.at}\n")

    def _join_failed(self, replica: int, epoch: int, why: str) -> None:
        join = self.joins.get(replica)
        if join is None or join.epoch != epoch:
            return
        self.log({"event": "join-failed", "replica": replica, "epoch": epoch, "why": why})
        # Told first, on the same connection as the generation: a member that learned the new
        # generation while it still held this join would admit it at the next step boundary in
        # that generation and wait there for one more, which no given-up join makes (the run
        # would stall until the next join timed out).
        self._end_join(epoch)
        # Whoever paused a step for this join goes on without it: a new generation.
        self._publish([m for m in self.members if m not in self.lost],
                      f"join of replica {replica} given up ({why})")
        join.epoch = -1
        if len(join.ranks) == join.nranks:  # still connected: another donor, another boundary
            self._announce_join(replica, join)

    def _end_join(self, epoch: int) -> None:
        for conn, p in list(self.peers.items()):
            if p.replica in self.members:
                self.wire.send(conn, f"joinend {epoch}\n")

    # -- a restarted coordinator -----------------------------------------------------------------
    def _resume_run(self, now: float) -> bool:
        """Once every replica re-registered, or none for 2 x stale_s, resume at the highest step
        a replica holds whole; heal the others by state transfer (`admission.resume_plan`).
        Generations continue after the newest any rank knew, so nothing of the dead
        coordinator's generations can be mistaken for this one's."""
        complete = sorted(r for r, rep in self.replicas.items() if len(rep.ranks) >= rep.nranks)
        quiet = now - self.last_hello > 2 * self.stale_s
        timed_out = now - self.started > self.join_timeout_s
        if not (len(complete) >= self.expected or (complete and quiet) or timed_out):
            return False
        plan = resume_plan({r: self.resume[r] for r in complete})
        if plan is None:
            why = (f"restarted coordinator: no replica holds a whole step to resume from "
                   f"(re-registered: {self.resume})")
            self.store.set(keys.COORD_ERROR, why)
            self.log({"event": "resume-failed", "why": why})
            self.generation, self.members = 0, []
            return False
        step, members, heal = plan
        self.floor = max(self.newest_seen + 1, 0)
        self.generation = self.floor - 1  # _publish makes floor
        for conn, p in list(self.peers.items()):
            if p.replica in members:
                self.wire.send(conn, f"welcome {self.floor} {self.params()}\n")
        self._publish(members, f"coordinator restarted: resuming at step {step}; replicas "
                               f"{heal} are healed by state transfer")
        self.log({"event": "resumed", "step": step, "members": members, "heal": heal,
                  "registered": {str(r): a for r, a in self.resume.items()}})
        self.exits.update({r: "running" for r in members})
        self._write_exits()
        for r in sorted(self.resume):  # incomplete ones join when their last rank arrives
            if r in members:
                continue
            rep = self.replicas.pop(r)
            join = self.joins[r] = Join(rep.nranks, ranks=set(rep.ranks),
                                        at=max(step, self.join_at.get(r, 0)))
            self._set_exit(r, "joining")
            if r in heal:
                self._announce_join(r, join)
        return True

    # -- what is published -----------------------------------------------------------------------
    def _publish(self, members: list[int], reason: str) -> None:
        g = self.generation + 1
        value = keys.encode_members(members)
        key = keys.members_key(g)
        # This coordinator is the only writer of a generation's members: a value already there
        # that is not authentic (a stranger's, written ahead; without a token, any other) is
        # replaced, and neither decides a membership nor stops this one (DESIGN.md, "Trust").
        foreign = keys.valid_members if self.token else (lambda v: False)
        try:
            stored = keys.put_once(self.store, self.token, key, value, foreign)
        except ValueError as e:  # rewritten as fast as we replaced it: ours is set regardless
            log.warning("generation %d: %s; set anyway", g, e)
            keys.set_sealed(self.store, self.token, key, value)
            stored = value
        if stored != value:  # authentic: two coordinators with this run's token share a store
            raise RuntimeError(f"generation {g} already has members {stored!r}")
        # Stored: push it now, as a change to the one published last (members know it: no store
        # read for them), then write what nobody waits for (the reason; the fallback's count).
        base = self.generation if self.published == self.generation else None
        push = keys.gen_push(g, base, self.members, members)
        self.member_since = {r: self.member_since.get(r, g) for r in members}
        self.generation, self.members, self.published = g, sorted(members), g
        if self.token:  # kept to put back (`Coordinator._reassert`): a rewrite must not strand a
            self.recent_members[key] = sealed.seal(self.token, key, value)  # reader of g
            for old in list(self.recent_members)[:-RECENT_GENERATIONS]:
                del self.recent_members[old]
        self.lost, self.pending_since, self.accusations, self.accused_since = {}, None, {}, None
        self.waiters = {}
        self.cuts, self.cut_reporters, self.cut_since = {}, [], None
        self.log({"event": "generation", "gen": g, "members": self.members, "reason": reason})
        self.wire.send_all(push)
        # One request for both (a failure's main-store work is counted per replica): the count
        # is only ever written here, so setting it is the add it was (a recover gap too).
        names, values = [keys.reason_key(g), keys.GEN_COUNT], [reason, str(g + 1)]
        if self._exits_due:  # how the lost ended, held for this request (`_write_exits`)
            names.append(keys.COORD_EXITS)
            values.append(self._exits_json())
            self._exits_due = False
        self.store.multi_set(names, values)
        self.gen_count = g + 1
        for r, join in sorted(self.joins.items()):  # replacements that came before this
            if r not in self.members and join.epoch < 0 and len(join.ranks) == join.nranks:
                self._announce_join(r, join)

    def _set_exit(self, replica: int, how: str, keep: bool = False) -> None:
        """Record how a replica ended (first word: left / lost / fenced) for the launcher."""
        if keep and self.exits.get(replica, "running") != "running":
            return  # already ended one way; a later sign (its connection closing) changes nothing
        self.exits[replica] = how
        self._write_exits()

    def _write_exits(self) -> None:
        """Store how each replica ended; while a publication is pending (debounced) the write
        waits for it and goes in its request (a failure's main-store work counts per replica);
        `flush_exits` writes one still held when no publication comes."""
        if self.pending_since is not None:
            self._exits_due = True
            return
        self._exits_due = False
        self.store.set(keys.COORD_EXITS, self._exits_json())

    def flush_exits(self, final: bool = False) -> None:
        """Write the exits held for a publication: if none is pending any more, or `final`
        (the coordinator stops serving)."""
        if self._exits_due and (final or self.pending_since is None):
            self._exits_due = False
            self.store.set(keys.COORD_EXITS, self._exits_json())

    def _exits_json(self) -> str:
        return json.dumps({str(r): v for r, v in sorted(self.exits.items())})
