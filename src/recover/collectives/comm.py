"""Generation-fenced fault-tolerant reduction.

Invariant: `reduce_(tensors)` leaves in each tensor the full sum over every member of one
generation, or raises `ReplicaFault` on this survivor within a bounded time; so does a reduction
issued piecewise (`open`, `issue` per tensor, e.g. a bucket from inside a backward, then
`complete` for all of them, or `abandon`). It never reports success for a partial sum, never
waits on a communicator past the moment a newer generation is known, and tells its caller
(`in_use`) which buffers an abandoned operation may still write into, so none is reused before
that operation ends. A group it stops using is retired, never destroyed on the caller's thread
nor while its work is in flight (`reaper.py`).

Cross-replica gloo traffic binds the address `netif.GlooInterface` chooses (the interface the user
names, else this host's end of its connection to the coordinator; never loopback towards another
host). An op that stalls past `suspect_s`, or fails, names to the coordinator the members this
rank's data path cannot reach (`reach`: a handshake to each one's listener, published beside its
gloo address), never a member that only answered late.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import PrefixStore

from recover.collectives import sever, tree
from recover.collectives.meshstore import MeshStore, new_group
from recover.collectives.reaper import retire
from recover.control import keys, reach, shards
from recover.control.listen import ListenError
from recover.control.member import CoordinatorLost, Member
from recover.control.netif import GlooInterface, GlooInterfaceError, is_loopback
from recover.control.spare import SpareClient
from recover.control.waiter import KeyWaiter
from recover.deadline import Deadline
from recover.errors import RecoverError
from recover.settings import FaultTolerance, Numerics

__all__ = ["FaultTolerantComm", "GlooInterfaceError", "ReplicaFault"]

log = logging.getLogger(__name__)

# How long a failed op waits for the coordinator to publish the generation that answers a crash
# (the dead process's liveness socket closed) before it probes the peers itself: several times
# the kill-to-publication time, even on a loaded host, so a crash is answered, never probed
# (docs/MEASUREMENTS.md, "The control plane at scale"). A cut's report comes this much later.
CRASH_SEEN_S = 0.25

ABANDON_SETTLE_S = 0.25  # after a newer generation, how long an op may still end by itself
SEVERED_SETTLE_S = 2.0  # how long a severed op may take to fail before its buffers are held


def _reach_key(prefix: str, rank: int) -> str:
    """`addr port` of a rank's probe listener in one communicator, beside its gloo address."""
    return f"{prefix}/reach/{rank}"


# The build's wait starts at `poll_s` and doubles up to this: a fixed short poll through a large
# build costs a large share of its CPU (docs/MEASUREMENTS.md, "The control plane at scale").
_BUILD_POLL_MAX_S = 0.025


class ReplicaFault(RecoverError, RuntimeError):
    """A reduction of `generation` did not complete here; `lost` are the replicas known gone."""

    def __init__(self, generation: int, lost: list[int], why: str) -> None:
        super().__init__(f"reduce in generation {generation} failed ({why}); lost {lost}")
        self.generation, self.lost, self.why = generation, lost, why


@dataclass
class _Held:
    """Buffers an abandoned operation may still write into (`in_use`), until it ends; the
    group itself is retired (`reaper.retire`)."""

    futs: list[torch.futures.Future]
    bufs: list[torch.Tensor]
    since: float = field(default_factory=time.monotonic)


@dataclass
class Flight:
    """One reduction in one generation's group: operations issued one at a time
    (`FaultTolerantComm.issue`, a bucket as soon as the backward has finished its part), waited
    for together (`complete`) or let go together (`abandon`). `pg` None: this member is alone
    in the generation, nothing to meet."""

    g: int
    pg: object | None
    hold: list[torch.Tensor]  # the buffers its operations write into
    works: list[Any] = field(default_factory=list)
    futs: list[torch.futures.Future] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)  # NCCL: one device event per operation
    error: Exception | None = None  # an issue the group refused
    tree_driver: tree.TreeDriver | None = None  # gloo: small payloads (collectives/tree.py)

    def clear(self) -> None:
        """Drop the references to the group and its work (a caller's frame may outlive it)."""
        self.pg, self.works, self.futs, self.events, self.tree_driver = None, [], [], [], None


class FaultTolerantComm:
    """The cross-replica communicator of one position (a shard index, a (tp, pp) rank, or 0)."""

    def __init__(self, member: Member, position: int = 0, ft: FaultTolerance | None = None,
                 numerics: Numerics | None = None, *, device: torch.device | None = None,
                 ifname: str | None = None, poll_s: float = 0.002, recheck_s: float = 0.1) -> None:
        """`ft.reduce_timeout_s` bounds every wait; `numerics.backend`: gloo or nccl."""
        backend = (numerics or Numerics()).backend
        timeout_s = (ft or FaultTolerance()).reduce_timeout_s
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown backend {backend!r}")
        if backend == "nccl" and (device is None or device.type != "cuda"):
            raise ValueError("the nccl backend needs device=torch.device('cuda', i)")
        self.backend, self.device = backend, device
        # A member missing at the barrier this long is named to the coordinator (evidence).
        self.suspect_s = (getattr(member, "fence_after_s", None) or 6.0) / 3
        # A probe of the peers' data path gives a handshake this long: a dropped SYN is resent
        # after 1 s, so at the default stale_s one loss on a working path is not a cut.
        self.probe_s = 2 * self.suspect_s
        self._listener: reach.Listener | None = None  # answers the peers' probes (gloo only)
        # Fault injection: while this returns True, cross-replica traffic fails here.
        self.link_down: Callable[[], bool] | None = None
        self.iface = GlooInterface(member.replica, ifname)  # the address gloo binds
        self.member, self.position = member, position
        # poll_s paces the barrier and the build wait; recheck_s bounds a reduce's sleep between
        # wake-ups (a missed event costs at most this much, never a hang).
        self.timeout_s, self.poll_s, self.recheck_s = timeout_s, poll_s, recheck_s
        self._pg: object | None = None
        self._pg_gen = -1
        self._socks: list[socket.socket] = []  # the gloo sockets of `_pg` (see `sever`)
        self._pg_store: MeshStore | None = None  # `_pg`'s store: gloo holds it
        self._tree: tree.TreeDriver | None = None  # `_pg`'s small payloads (gloo)
        # The sockets of groups let go, closed only once the next group's barrier has passed
        # (every member has left the older ops by then): closed earlier, a slower peer's send
        # on one is reset, and gloo loses it (docs/MEASUREMENTS.md, "Severing a gloo operation").
        self._closing: list[socket.socket] = []
        self._holding: list[_Held] = []
        # Where every group of this position meets (barrier, addresses, gloo's own exchange):
        # the main store, or with store shards the one shard every member of the position picks
        # alike, a joiner and a rank that skipped generations too (`shards.rendezvous_shard`).
        # Why: a rebuild makes O(R) lookups per member; on the main store that would be its largest
        # work per failure (docs/DESIGN.md, "Scaling the control plane").
        self.rendezvous = self._rendezvous_store(member, position)
        self._waiter = KeyWaiter(member, self.rendezvous)  # blocking reads for the build barrier
        self._spare = SpareClient(self.rendezvous.clone)  # each build's own rendezvous client
        # Cumulative, for profilers: seconds building groups / in barriers / in reduces, this
        # process's CPU seconds (every thread) while it built groups (barrier included), and
        # the collectives issued (one per tensor of a reduce; `tree_ops` of them up and down the
        # tree), and the probes of the peers' data path this rank started (`reach`).
        self.stats: dict[str, float] = {"build_s": 0.0, "barrier_s": 0.0, "reduces": 0,
                                        "reduce_s": 0.0, "build_cpu_s": 0.0, "collectives": 0,
                                        "tree_ops": 0, "probes": 0}

    # -- public ------------------------------------------------------------------------------
    def reduce_(self, tensors: Sequence[torch.Tensor], generation: int | None = None,
                on_issued: Callable[[], None] | None = None) -> None:
        """Sum each of `tensors` in place over the members of `generation` (default: newest).

        On return every tensor holds the full sum; on `ReplicaFault` their contents are
        undefined, and a tensor an abandoned operation may still write into is reported by
        `in_use()` until that operation ends (the caller must not reuse it before)."""
        flight = self.open(generation, tensors)
        for t in tensors:
            self.issue(flight, t)
        self.complete(flight, on_issued)

    def ready(self, generation: int) -> bool:
        """Whether `open(generation)` would return at once with a group to issue into: this
        member is in it, it is the newest, its group is built and the data path is up. A caller
        that issues from inside a backward (a bucket) opens only then: it must not block on a
        rebuild nor raise there."""
        return (not self.member.fenced and self.member.generation() == generation
                and self._pg is not None and self._pg_gen == generation
                and self.member.replica in self.member.members(generation)
                and len(self.member.members(generation)) > 1
                and not (self.link_down is not None and self.link_down()))

    def open(self, generation: int | None = None, hold: Sequence[torch.Tensor] = ()) -> Flight:
        """Start a reduction in `generation` (default: newest): its group, built if need be;
        `hold` are the buffers its operations will write into (held after an abandon, `in_use`).
        Raises `ReplicaFault` as `reduce_` does when this member cannot reduce in it."""
        g = self.member.generation() if generation is None else generation
        members = self.member.members(g)
        if self.member.fenced or self.member.replica not in members:
            raise ReplicaFault(g, [self.member.replica],
                               f"replica {self.member.replica} is fenced (not in generation {g})")
        if len(members) == 1:
            self._close_old()  # no peer left to meet, nor to wait for
            self._superseded(g)
            return Flight(g, None, [])
        if self.link_down is not None and self.link_down():
            # Fault injection (`partition`): no peer is reachable on the data path; reported as
            # its probes (`reach`) would, for the cut rule (`admission.cut_off`) to decide.
            others = [m for m in members if m != self.member.replica]
            self.member.report_cut(g, others)
            raise ReplicaFault(g, [], "partitioned: no peer reachable")
        pg = self._group(g, members)
        return Flight(g, pg, list(hold), tree_driver=self._tree)

    def issue(self, flight: Flight, tensor: torch.Tensor) -> None:
        """Start summing `tensor` in place in `flight`'s group; never blocks on the peers. An
        error is kept for `complete` to raise (a group a peer's death already failed may refuse
        new work)."""
        if flight.pg is None or flight.error is not None:
            return
        if flight.tree_driver is not None and tree.fits(tensor):
            # Up and down a binary tree on the group's own thread: O(1) peers per member where
            # gloo's ring takes 2(R - 1) steps (collectives/tree.py).
            fut, kept = flight.tree_driver.submit(tensor)
            flight.works.append(kept)
            flight.futs.append(fut)
            self.stats["collectives"] += 1
            self.stats["tree_ops"] += 1
            return
        try:
            work = flight.pg.allreduce([tensor])  # type: ignore[attr-defined]
        except Exception as e:
            flight.error = e
            return
        flight.works.append(work)
        flight.futs.append(work.get_future())
        if self.backend == "nccl":
            # NCCL's futures may complete before the device does (no host callback at the end):
            # its completion is an event recorded after the collective on the current stream.
            work.wait()  # only orders the current stream after the collective; does not block
            ev = torch.cuda.Event()
            ev.record()
            flight.events.append(ev)
        self.stats["collectives"] += 1

    def complete(self, flight: Flight, on_issued: Callable[[], None] | None = None) -> None:
        """Wait until every operation of `flight` has ended: on return each tensor issued in it
        holds the full sum over its generation's members; else `ReplicaFault` within the bounds
        of `reduce_`'s invariant (its group is then severed and retired)."""
        if flight.pg is None:  # alone in the generation: nobody to meet
            if on_issued is not None:  # the step reached its reduce, even with nobody to meet
                on_issued()
            return
        g, pg, works, futs = flight.g, flight.pg, flight.works, flight.futs
        t0 = time.monotonic()
        done = self._completion(flight)
        # One event for "every op finished or the membership changed": the thread sleeps until
        # either happens instead of waking every few ms to compare generations.
        wake = threading.Event()
        for fut in futs:
            fut.add_done_callback(lambda _: wake.set())
        self.member.notify_on_change(wake)
        if on_issued is not None:
            on_issued()
        watch, deadline = self._watch(g, waits=True), Deadline(self.timeout_s)
        # NCCL's completion is polled from device events at the fine pace.
        pace = self.poll_s if self.backend == "nccl" else self.recheck_s
        try:
            while flight.error is None and not done():
                self.member.watch.progress()  # a legitimate wait, not a stuck thread
                wake.wait(min(pace, deadline.left()))
                wake.clear()
                if done():
                    break
                watch.turn(time.monotonic() - t0)  # stalled: is a peer cut off from us?
                if self.member.generation() != g:
                    # The op can no longer commit in g: end it now (`_abandon`), so the last
                    # survivor is not held up waiting for a failure to travel round the ring.
                    self.abandon(flight)
                    raise ReplicaFault(g, self._lost_since(g), "a newer generation was published")
                if deadline.passed():
                    self.abandon(flight)
                    self._report_fail(watch, g)
                    raise ReplicaFault(g, [], f"no completion within {self.timeout_s:.0f}s")
        finally:
            self.member.notify_on_change(wake, on=False)
        try:
            if flight.error is not None:
                raise flight.error
            for fut in futs:
                fut.value()
        except Exception as e:
            # Sever our side of the group (the other members' pending ops fail within ms, not at the
            # timeout: docs/MEASUREMENTS.md, "gloo on CPU") and retire it: never destroyed here,
            # gloo's destructor waits for its threads and closes a pair per peer (seconds at a
            # large R).
            # Only the writing side while nothing of ours runs: the peers read end-of-file, and
            # their sends still land (a socket shut both ways answers data with a reset, `sever`).
            self._sever(pg, socket.SHUT_WR if all(f.done() for f in futs) else socket.SHUT_RD)
            self._release(pg, works, futs)
            flight.clear()
            works, futs, pg = [], [], None  # this frame outlives the raise (its traceback)
            self._report_fail(watch, g)
            raise ReplicaFault(g, self._lost_since(g), str(e).splitlines()[0][:200]) from None
        if self.member.fenced:  # resumed after being fenced: its result must not be used
            raise ReplicaFault(g, [self.member.replica], "fenced while reducing")
        watch.ended()
        self._reap()
        self.stats["reduces"] += 1
        self.stats["reduce_s"] += time.monotonic() - t0

    def abandon(self, flight: Flight) -> None:
        """Let `flight` go unfinished (its generation can no longer commit, or its caller gave
        up): its operations are ended as `reduce_` ends a superseded one, its buffers held until
        they have (`in_use`), its group retired."""
        if flight.pg is not None:
            self._abandon(flight.pg, flight.works, flight.futs, flight.hold)
        flight.clear()

    def _completion(self, flight: Flight) -> Callable[[], bool]:
        """A non-blocking test of "every op is complete", never a host read of a result before
        that: gloo completes its futures when the op is done; NCCL's work is known complete only
        when a device event recorded after it has passed (a host watchdog, `complete`'s loop,
        aborts the communicator on a timeout or a newer generation instead of waiting)."""
        if self.backend != "nccl":
            futs = flight.futs
            return lambda: all(f.done() for f in futs)
        events = flight.events
        return lambda: all(ev.query() for ev in events)

    def in_use(self, tensor: torch.Tensor) -> bool:
        """Whether an abandoned operation may still write into `tensor`'s memory."""
        self._reap()
        ptr = tensor.data_ptr()
        return any(b.data_ptr() == ptr for h in self._holding for b in h.bufs)

    def close(self) -> None:
        self._sever(self._pg, socket.SHUT_WR)  # nobody will use it again: peers' ops end now
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._drop()
        self._holding.clear()
        self._close_old()
        self._waiter.close()
        self._spare.close()

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _rendezvous_store(member: Member, position: int) -> Any:
        """The main store's plain client without shards (gloo holds its clones: not the
        counting one, control/storecount.py); else a client of this position's shard,
        connected now (a rebuild opens no connection on its critical path: its clients are
        clones)."""
        count = len(getattr(member, "shard_ports", None) or [])
        if count == 0:
            return member.plain_store
        return member.connect_shard(shards.rendezvous_shard(position, count))

    def _lost_since(self, g: int) -> list[int]:
        newest = self.member.generation()
        if newest == g:
            return []
        return sorted(set(self.member.members(g)) - set(self.member.members(newest)))

    def _superseded(self, g: int) -> None:
        if self.member.generation() != g:
            raise ReplicaFault(g, self._lost_since(g), "a newer generation was published")

    def _group(self, g: int, members: list[int]) -> object:
        if self._pg is not None and self._pg_gen == g:
            return self._pg
        self._drop()
        rank, size = members.index(self.member.replica), len(members)
        prefix = keys.comm_prefix(g, self.position)
        t0, c0 = time.monotonic(), time.process_time()
        addr = (self.iface.bind(self.member.local_addr, self.member.host,
                                self.member.coordinator_remote)
                if self.backend == "gloo" else None)
        if addr is not None:
            self._publish_addr(prefix, rank, addr)
        self._barrier(g, prefix, size)
        self._close_old()  # every member left the older generations' ops by now
        if addr is not None and is_loopback(addr):
            addr = self.iface.off_loopback(addr, self._peer_addrs(prefix, rank, size))
        t1 = time.monotonic()
        # Build in a helper thread: if a member dies between the barrier and the build, the
        # constructor would block for its whole timeout; we give up as soon as g is superseded.
        box: dict[str, Any] = {}
        # Connections to the coordinator (store, shards, liveness) are not the group's.
        spare = {self.member.port, self.member.live_port, *self.member.shard_ports}

        def build() -> None:
            try:
                # A new client each build (reusing an ended build's broke pipes to the store:
                # docs/MEASUREMENTS.md, "TCPStore"), connected ahead of need (`spare`); one
                # connected now resolves the peer's name, which can take a DNS timeout (5 s):
                # here, not on the caller's thread, which keeps showing progress meanwhile.
                store: Any = PrefixStore(prefix + "/pg", self._spare.take(prepare_next=False))
                if self.backend == "gloo":  # O(1) requests per member for gloo's full mesh
                    store = MeshStore(store, size)
                box["store"] = store
                before = sever.sockets() if self.backend == "gloo" else {}
                pg = new_group(self.backend, store, rank, size, self.timeout_s,
                                self.iface.ifname, addr)
                if self.backend == "gloo":
                    box["socks"] = sever.opened_since(before, spare)
                if self.backend == "nccl":  # connect now, inside the abandonable build, not
                    pg.eager_connect_single_device(self.device)  # lazily at the first reduce
                box["pg"] = pg
            except Exception as e:
                box["err"] = e

        th = threading.Thread(target=build, name=f"recover-build-g{g}", daemon=True)
        th.start()
        deadline = Deadline(self.timeout_s)
        watch = self._watch(g)
        pace = self.poll_s
        while th.is_alive():
            self.member.watch.progress()
            th.join(pace)
            pace = min(2 * pace, _BUILD_POLL_MAX_S)
            if th.is_alive() and self.member.generation() != g:
                raise ReplicaFault(g, self._lost_since(g), "superseded while building")
            watch.turn(time.monotonic() - t1)  # gloo's connect names no peer: probe them
            if deadline.passed():
                self._report_fail(watch, g)  # ask for a rebuild rather than wait for nobody
                raise ReplicaFault(g, [], "communicator build timed out")
        if "err" in box:
            self._report_fail(watch, g)
            why = str(box["err"]).splitlines()[0][:300]
            self.iface.hint(why, addr)
            raise ReplicaFault(g, [], f"communicator build failed: {why}")
        self.stats["barrier_s"] += t1 - t0
        self.stats["build_s"] += time.monotonic() - t1
        self.stats["build_cpu_s"] += time.process_time() - c0
        self._pg, self._pg_gen, self._pg_store = box["pg"], g, box["store"]
        self._socks = box.get("socks", [])  # type: ignore[assignment]
        if self.backend == "gloo":
            self._tree = tree.TreeDriver(self._pg, rank, size, self.timeout_s,
                                         f"recover-tree-g{g}")
        self._spare.prepare()  # the next build's client, connected while this group is used
        return self._pg

    def _publish_addr(self, prefix: str, rank: int, addr: str) -> None:
        """Publish the address gloo binds and, beside it, where this rank answers the peers'
        probes (one round trip for both)."""
        if self._listener is not None and self._listener.addr != addr:
            self._listener.close()
            self._listener = None
        if self._listener is None:
            try:
                self._listener = reach.Listener(addr)
            except ListenError as e:  # no probes of us: a cut is then only a failure here
                log.warning("replica %d: no data-path probe listener: %s", self.member.replica, e)
        names, values = [keys.gloo_addr(prefix, rank)], [addr]
        if self._listener is not None:
            names.append(_reach_key(prefix, rank))
            values.append(f"{addr} {self._listener.port}")
        self.rendezvous.multi_set(names, values)

    def _watch(self, g: int, waits: bool = False) -> reach.PathWatch:
        """One op's evidence: whom this rank's data path cannot reach, named once to the
        coordinator (`Member.report_cut`); `waits` (a reduce, which names nobody): that it
        waits past suspect_s, until it ends (`Member.report_waiting`, `report_arrived`)."""
        waiting = ((lambda: self.member.report_waiting(g)),
                   (lambda: self.member.report_arrived(g))) if waits else None
        return reach.PathWatch(lambda: self._probe(g),
                               lambda names: self.member.report_cut(g, names), self.suspect_s,
                               waiting)

    def _report_fail(self, watch: reach.PathWatch, g: int) -> None:
        """An op of g failed here: name whom a probe cannot reach first (gloo's error cannot),
        so the coordinator weighs the cut before the bare request to rebuild. A failure that a
        newer generation answers within `CRASH_SEEN_S` (a crash) is not probed."""
        watch.settle(lambda: self.member.generation() != g, self.poll_s * 10,
                     answered=lambda: self._newer_within(g, CRASH_SEEN_S))
        self.member.report_fail(g)

    def _newer_within(self, g: int, timeout_s: float) -> bool:
        """Whether a generation newer than g is known within `timeout_s` (False: the
        coordinator is gone, which is the caller's next check)."""
        with contextlib.suppress(TimeoutError, CoordinatorLost):
            self.member.wait_newer(g, timeout_s)
        return self.member.generation() != g

    def _probe(self, g: int) -> reach.Probe | None:
        """A probe of every other member of g at this position (None: no listener here, or a
        member published no probe address: nothing to compare)."""
        members = self.member.members(g)
        if self._listener is None or self.member.replica not in members:
            return None
        prefix, rank = keys.comm_prefix(g, self.position), members.index(self.member.replica)
        others = [r for r in range(len(members)) if r != rank]
        names = [_reach_key(prefix, r) for r in others]
        if not names or not self.rendezvous.check(names):
            return None
        found = {members[r]: reach.parse(v)
                 for r, v in zip(others, self.rendezvous.multi_get(names), strict=True)}
        peers = {m: a for m, a in found.items() if a is not None}
        self.stats["probes"] += 1
        return reach.Probe(self._listener.addr, peers, self.probe_s)

    def _peer_addrs(self, prefix: str, rank: int, size: int) -> list[str] | None:
        """The addresses the group's other ranks bind (None: one of them published none)."""
        names = [keys.gloo_addr(prefix, r) for r in range(size)]
        if not self.rendezvous.check(names):
            return None
        addrs = self.rendezvous.multi_get(names)
        return [a.decode() for r, a in enumerate(addrs) if r != rank]

    def _barrier(self, g: int, prefix: str, size: int) -> None:
        """Wait until every member of g arrived; give up as soon as g is superseded. A member
        that has not arrived after `suspect_s` is named to the coordinator (evidence: it is
        evicted only if that convicts it, `admission.convicted`: its main thread stalled, or it
        reaches nobody), and the naming is withdrawn if it arrives after all.
        The last to arrive sets `{prefix}/all`; the others block on it (`KeyWaiter`, woken by a
        newer generation) instead of polling the count: every member polling floods the one
        store server during a rebuild and slows every survivor's protocol round trips through
        it."""
        store = self.rendezvous
        rank = self.member.members(g).index(self.member.replica)
        store.set(f"{prefix}/arrived/{rank}", "1")
        if store.add(f"{prefix}/arrive", 1) >= size:
            store.set(f"{prefix}/all", "1")
            return
        start = time.monotonic()
        deadline, suspect = Deadline(self.timeout_s, at=start), Deadline(self.suspect_s, at=start)
        named, accused = False, False
        while True:
            until = deadline if named else deadline.sooner(suspect)
            if self._waiter.get(f"{prefix}/all", g, until.left()):
                if accused:
                    self.member.report_arrived(g)  # they were late, not lost: withdraw
                return
            self._superseded(g)
            self.member.check()
            if deadline.passed():
                self.member.report_fail(g)
                raise ReplicaFault(g, [], "barrier timed out")
            if not named and suspect.passed():
                named = True
                members = self.member.members(g)
                missing = [members[r] for r in range(size)
                           if not store.check([f"{prefix}/arrived/{r}"])]
                if missing:
                    accused = True
                    self.member.report_fail(g, missing)
            time.sleep(self.poll_s)  # a waiter that failed (its client died) is not a spin

    def _abandon(self, pg: object, works: list[Any], futs: list[torch.futures.Future],
                 bufs: Sequence[torch.Tensor]) -> None:
        # A peer may be hung with its sockets open: gloo would write into `bufs` until its own
        # timeout. Shutting the group's connections down for reading ends the op within ms (`sever`:
        # not for writing, which can lose a send inside gloo; the peers shut their own for the same
        # generation); without a socket known, a dead peer still fails it well within the settle
        # (docs/MEASUREMENTS.md, "gloo on CPU"). Only an op running after the settle keeps its
        # buffers held (`in_use`).
        severed = self._sever(pg, socket.SHUT_RD)
        if self.backend == "nccl":
            # Unlike gloo, aborting an NCCL communicator ends the operations in flight
            # (ncclCommAbort), after which the buffer is no longer written.
            with contextlib.suppress(Exception):
                pg.abort()  # type: ignore[attr-defined]
        else:
            # Severed, the op fails as soon as gloo's loop thread runs (ms, but on a loaded host
            # past a short settle, and then a second buffer is made: docs/MEASUREMENTS.md,
            # "Memory"): wait longer, woken by its futures.
            ended = threading.Event()
            for fut in futs:
                fut.add_done_callback(lambda _: ended.set())
            settle = Deadline(SEVERED_SETTLE_S if severed else ABANDON_SETTLE_S)
            while not all(f.done() for f in futs) and not settle.passed():
                ended.wait(settle.left())
                ended.clear()
        if not all(f.done() for f in futs):
            # After an NCCL abort nothing writes into the buffers any more: only gloo's are held.
            self._holding.append(_Held(futs, [] if self.backend == "nccl" else list(bufs)))
        self._release(pg, works, futs)

    def _sever(self, pg: object, how: int) -> bool:
        """Shut down our side of `pg`'s connections (`how`: both ways, or one) if it is the
        current group (gloo only: no socket is recorded for NCCL); whether any was."""
        return self._pg is pg and sever.sever(self._socks, how) > 0

    def _release(self, pg: object, works: Sequence[Any] = (),
                 futs: Sequence[torch.futures.Future] = ()) -> None:
        """Stop using `pg` (if it is the current group, its sockets go to `_closing`); the
        reaper destroys it once its work has ended."""
        if self._pg is pg:
            self._closing += self._socks
            works = (*works, self._pg_store)  # gloo holds it: it goes with the group
            if self._tree is not None:
                self._tree.close()  # its thread drops the group after its current operation
            self._pg, self._pg_gen, self._socks, self._pg_store = None, -1, [], None
            self._tree = None
        retire(pg, works, futs)

    def _close_old(self) -> None:
        sever.release(self._closing)
        self._closing = []

    def _drop(self) -> None:
        self._release(self._pg)
        self._reap()

    def _reap(self) -> None:
        now = time.monotonic()
        keep = 3 * self.timeout_s
        self._holding = [h for h in self._holding
                         if not all(f.done() for f in h.futs) and now - h.since < keep]
