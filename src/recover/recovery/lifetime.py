"""The lifetime of the step protocol's store keys: deleted once no rank can read them again.

Invariant: the protocol keys of the i-th step an engine committed (its tag: the step, or
`{t}.{round}` for a step run again in exact mode) are deleted when its (i+2)-th commit is
decided, by one rank, and by nobody else: the chain entries (`step/{t}/chain/{k}`), and for each
generation g of that chain the count, the decision and the evidence counters (`step/{t}/g{g}/...`)
on the main store, and the count and the decision copy on each store shard. The app's keys (the
trainer's step records `rec/{t}`) are not the protocol's: their writer's app deletes them.

Why nobody can read a key of commit i once commit i + 2 is decided (docs/DESIGN.md, "Store keys
and the wire protocol"):
- A rank reads commit i's keys only inside the engine's `run` for its tag, which returns after
  reading commit i's decision and never reads them again (the next `run` has its own tag).
- Commit i + 1 is decided only when every live rank of its generation counted a verified result
  of it (or, on evidence, every rank of the newest generation that was also in it): each of those
  had returned from commit i's `run` before. So after commit i + 2 every one of them had left
  commit i one whole step before, and every request it sent about commit i was served, even a
  write sent without waiting for a reply (a decision's copy on a shard after a failed reduce,
  `set`): the requests it made later on that client (commit i + 1's) were answered after it.
  The coordinator's copies into the shards (control/shards.py) come before any rank of a
  shard reads its decision, so before any of them counts commit i + 1.
- A rank not in those generations was dropped from the membership: dead, or fenced as soon as it
  learns of the newer generation (control/member.py). Until then it may still block on, or
  even re-create, one of commit i's keys; that misleads only itself, and leaves a key behind.
- A joiner starts at a stored entry 0 of the step it is admitted at (recovery/chain.py) and reads
  no earlier step's keys; a restarted coordinator starts with an empty store.

Who deletes: on the main store, position 0 of the lowest replica that is a member both of
commit i's generation and of commit i + 2's (it committed both, so it holds commit i's chain);
on store shard k, the lowest such (replica, position) counting on shard k (with a speaker,
a replica's position 0 counts for it), so each shard's deletions come from one of its own
ranks, never one rank for all shards. The deletions run on a
background thread with its own client, off the step's critical path: the engine's 2 round trips
per rank per step failure-free (`stats["store_ops"]`) are unchanged. Failure-free they cost the
deleting rank 2 or 3 requests a step on the main store (count, decision, and entry 0 when it was
stored; with store shards no count: 1 or 2) and 2 per shard for each shard's deleting rank
(`stats["store_deletes"]`).

Left behind, a bounded few keys per event, never per step: the last two commits' keys when the
run ends; an evidence counter of a generation the deleting rank had not yet learned when it
committed that step (another rank, still waiting for the decision, learned it first); two
commits' keys after a join, a restart of the coordinator, or the death of the deleting rank
(whoever should delete them has no record of them); a key re-created by a rank that was
dropped; and a step's keys when more than `SPILL_MAX` keys wait for deletion (the store answers
slower than the steps commit; logged).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from recover.control import Member, keys, shards
from recover.recovery.decide import counting
from recover.recovery.strategy import Chain

log = logging.getLogger(__name__)

KEEP = 2  # commits whose keys stay: commit i's keys go when commit i + KEEP is decided
QUEUE_MAX = 16  # deletion jobs waiting at most; beyond, their keys wait in the spill
# Key names held past a full queue, at most: the deletion client's connect can sit 5 s in a
# DNS lookup (docs/MEASUREMENTS.md, "TCPStore"), many steps of a tiny model; beyond, a step's
# keys are left (see above). ~30 bytes a name.
SPILL_MAX = 100_000
CLOSE_WAIT_S = 2.0  # how long `close` waits for a deletion in flight


@dataclass(frozen=True)
class Committed:
    """What a commit left in the store, as the committing rank knows it."""

    tag: int | str
    chain: Chain  # the chain it committed on
    implied: bool  # entry 0 was implied by the commit before, not stored
    generation: int  # the generation it committed in
    members: list[int]  # that generation's members (sorted)
    # The newest generation this rank knew when it committed: a rank counts evidence for the
    # step only while it waits for its decision, so only generations up to about this one can
    # have evidence counters (-1: unknown, every one up to the deleting commit's generation).
    newest: int = -1


def first_on_shard(members: list[int], positions: int, n_shards: int, shard: int
                   ) -> tuple[int, int] | None:
    """The lowest (replica, position) of `members` (sorted) that counts on `shard`."""
    for m in members:
        p = (shard - m * positions) % n_shards  # shards.shard_of(m, p, ...) == shard
        if p < positions:
            return m, p
    return None


def protocol_keys(old: Committed, newest: int, counts: bool = True,
                  token: str | None = None) -> list[str]:
    """The main store's keys of commit `old`; evidence counters up to generation `newest`
    (counted while a decision waited: none in a failure-free step). `counts`: the counts too
    (not with store shards: the ranks count on their shards, the coordinator tops the tree in
    its memory, control/shards.py)."""
    first = 1 if old.implied else 0
    out = [keys.chain_key(old.tag, k) for k in range(first, len(old.chain))]
    for g in sorted({int(e["gen"]) for e in old.chain}):
        out += [keys.count_key(old.tag, g, token)] if counts else []
        out += [keys.decision_key(old.tag, g)]
        out += [keys.evidence_key(old.tag, g, s, token) for s in range(g + 1, newest + 1)]
    return out


def shard_keys(old: Committed, token: str | None = None) -> list[str]:
    """A store shard's keys of commit `old`: its count and its copy of each decision."""
    out = []
    for g in sorted({int(e["gen"]) for e in old.chain}):
        out += [keys.count_key(old.tag, g, token), keys.decision_key(old.tag, g)]
    return out


class KeyLifetime:
    """One rank's part in deleting the protocol's keys (see the module docstring).

    `committed(c)` is called by the engine after each commit; `close()` stops the deletion
    thread (it also ends with the process: a daemon).
    """

    def __init__(self, member: Member, position: int, positions: int,
                 stats: dict[str, float], speaker: bool = False) -> None:
        self.member, self.position = member, position
        self.token = getattr(member, "token", None)  # names the counters (keys.count_key)
        self.me = member.replica
        self.stats = stats
        self.n_shards = len(member.shard_ports)
        # The ranks that count on the shards: with a speaker, position 0 of each replica alone
        # (recovery/decide.py); the others delete nothing there.
        self.at, self.positions, _ = counting(position, positions, speaker)
        self.shard_deleter = not speaker or position == 0
        self.shard = (shards.shard_of(self.me, self.at, self.positions, self.n_shards)
                      if self.n_shards else -1)
        self._history: deque[Committed] = deque(maxlen=KEEP)
        self._jobs: queue.Queue[tuple[str, list[str]] | None] = queue.Queue(QUEUE_MAX)
        # Past a full queue, names wait here per store (deleted after the job in hand): a
        # stall of the deletion thread delays deletions, it does not leave keys behind.
        self._spill: dict[str, list[str]] = {}
        self._spill_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = False  # close() was called: no new jobs
        self._closed = False  # the thread stops at its next deletion
        self._full_logged = False
        # Per store, the deletions queued, and those ended (sent, or dropped with their job):
        # each counter written by one thread only (the engine's, the deletion thread's).
        self._queued: dict[str, int] = {"main": 0, "shard": 0}
        self._ended: dict[str, int] = {"main": 0, "shard": 0}

    def committed(self, c: Committed) -> None:
        """Commit `c` was decided: queue the deletion of the keys of the commit KEEP before it,
        if this rank is the one to delete them (no store request on this thread)."""
        old = self._history[0] if len(self._history) == KEEP else None
        self._history.append(c)
        if old is None or self._closing:
            return
        # Both commits' members: the rank that deletes has a record of `old`.
        both = c.members if old.generation == c.generation else sorted(
            set(c.members) & set(old.members))
        if not both:
            return
        if both[0] == self.me and self.position == 0:
            # Evidence counters only up to the newest generation we knew at that commit:
            # deleting ones never written cost a request each after every failure. One
            # written by a rank that learned a newer generation in the same instant as the
            # decision is left behind (a key per event, not per step: see above).
            newest = c.generation if old.newest < 0 else min(old.newest, c.generation)
            self._queue("main", protocol_keys(old, newest, counts=not self.n_shards,
                                              token=self.token))
        if self.n_shards and self.shard_deleter and first_on_shard(
                both, self.positions, self.n_shards, self.shard) == (self.me, self.at):
            self._queue("shard", shard_keys(old, self.token))

    def close(self) -> None:
        """Stop the deletion thread once the jobs already queued are done, waiting for them up
        to CLOSE_WAIT_S (what is left then stays in the store); idempotent.

        Also run at interpreter exit: a daemon thread still inside a store call when the
        interpreter finalizes is ended inside C++ code that may not be unwound, which aborts
        the process ("terminate called without an active exception": once in 8 worker exits of
        tests/test_key_lifetime.py before this).
        """
        self._closing = True  # no new jobs
        thread = self._thread
        if thread is None or self._closed:
            self._closed = True
            return
        atexit.unregister(self.close)
        try:
            self._jobs.put_nowait(None)  # the thread ends when it reaches this
        except queue.Full:
            self._closed = True  # no room: it ends after its current deletion
        if thread is not threading.current_thread():
            thread.join(CLOSE_WAIT_S)
        self._closed = True

    def pending(self, where: str = "main") -> int:
        """Deletions on the `where` store queued and not yet sent: the requests this rank has
        already committed to (bench/scale.py counts them at each commit, so a deletion thread
        running behind does not move a failure's requests from one step to the next)."""
        return self._queued[where] - self._ended[where]

    def _queue(self, where: str, names: list[str]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="recover-key-lifetime",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.close)
        try:
            self._queued[where] += len(names)
            self._jobs.put_nowait((where, names))
            return
        except queue.Full:
            pass
        with self._spill_lock:
            held = self._spill.setdefault(where, [])
            if len(held) + len(names) <= SPILL_MAX:
                held.extend(names)
                return
        self._queued[where] -= len(names)  # left in the store (below)
        if not self._full_logged:
            self._full_logged = True
            log.warning("the store answers slower than steps commit: %d keys wait for deletion; "
                        "old steps' keys are left in the store", SPILL_MAX)

    def _loop(self) -> None:
        clients: dict[str, Any] = {}
        while not self._closed:
            try:
                job = self._jobs.get(timeout=1.0)
            except queue.Empty:
                job = ("", [])  # nothing queued: the spill only
            with self._spill_lock:
                spilled, self._spill = list(self._spill.items()), {}
            for where, names in ([] if job is None else [job]) + spilled:
                if names and not self._delete(clients, where, names):
                    return
            if job is None:  # close(): what was queued before it and the spill are done
                return

    def _delete(self, clients: dict[str, Any], where: str, names: list[str]) -> bool:
        """Delete `names` on the `where` store; False once `close` was called."""
        tried = 0
        try:
            client = clients.get(where)
            if client is None:  # its own connection: the engine's is the critical path's
                client = clients[where] = (self.member.store.clone() if where == "main"
                                           else self.member.connect_shard(self.shard))
            for name in names:
                if self._closed:
                    return False
                tried += 1
                self._ended[where] += 1
                client.delete_key(name)
                self.stats["store_deletes"] += 1
        except Exception as e:  # the store went away (a coordinator restart): drop the job
            self._ended[where] += len(names) - tried
            clients.pop(where, None)
            log.debug("deleting old step keys on the %s store failed: %s", where, e)
        return True
