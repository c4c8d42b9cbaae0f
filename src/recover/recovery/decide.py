"""The commit decision of one attempt of a step: the engine's agreement through the store.

Invariant: an attempt's decision (`step/{t}/g{g}/decision`) is written once, on the main store,
by compare-and-set, sealed with the run's token (a value there that is not authentic is
replaced and never read as a decision: `keys.put_once`, `keys.opener`); `commit` only when
every position of every surviving member of g holds a verified result. A store shard's
decision key (control/shards.py) only ever holds a copy of it. Failure-free this costs
each counting rank two round trips (with store shards too: the coordinator tops the count
tree); after a membership change the survivors decide on evidence (their written outcomes)
instead.

A multi-rank replica given a `ReplicaLink` has one speaker (position 0): its positions first
agree inside the replica (one intra-replica collective) that every one of them verified its
reduce of g; then the speaker alone counts all of them (`add` of P), waits, decides on evidence
or writes `redo`, and hands the decision to its siblings (one more). Counting P for P verified
positions keeps every total the same, so a replica with a speaker and one without decide
alike; a position that fails or skips g makes the agreement fail, and then nobody of the replica
counts g (so g cannot commit with it) and the speaker writes `redo` (the link and the order of
its calls: recovery/speaker.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from recover.control import Member, keys, shards
from recover.control.storecount import CountedStore, Tally
from recover.control.waiter import KeyWaiter
from recover.deadline import Deadline
from recover.recovery.failures import RecoveryError
from recover.recovery.speaker import ReplicaLink, speak
from recover.recovery.strategy import Chain

log = logging.getLogger(__name__)


def counting(position: int, positions: int, speaker: bool) -> tuple[int, int, int]:
    """(the position this rank counts as, ranks counting per replica, weight of its count):
    with a speaker, position 0 counts all P positions at once; else each counts itself."""
    if speaker:
        return 0, 1, positions
    return position, positions, 1


class CommitDecision:
    """One rank's side of every attempt's decision.

    `store` (counted) and `waiter` are the rank's main-store client and its blocking reads;
    with store shards a counting rank builds its own client of its shard, counted in `tally`
    (the engine's: `stats["store_ops"]`), and a waiter on it.
    `commit_value(step, g)` is what a commit writes (`commit`, or `commit-plan` when the next
    plan must go through the store: recovery/chain.py). `link`: this replica's `ReplicaLink`
    (a multi-rank replica with a speaker; see the module's docstring).
    """

    def __init__(self, member: Member, store: Any, waiter: KeyWaiter, position: int,
                 positions: int, timeout_s: float, commit_value: Callable[[int, int], bytes],
                 tally: Tally, link: ReplicaLink | None = None) -> None:
        self.member, self.store, self.waiter = member, store, waiter
        self.me, self.position, self.positions = member.replica, position, positions
        self.timeout_s, self.commit_value = timeout_s, commit_value
        self.token = getattr(member, "token", None)  # seals the decisions (control/sealed)
        self.link = link if positions > 1 else None
        at, counters, self.weight = counting(position, positions, self.link is not None)
        self.counts = self.link is None or position == 0  # this rank talks to the store
        # With store shards the failure-free count and decision go through this rank's shard;
        # the main store keeps the decision of record.
        n_shards = len(member.shard_ports)
        self.shard: Any = None
        self.shard_waiter: KeyWaiter | None = None
        if n_shards and self.counts:
            self.shard_index = shards.shard_of(self.me, at, counters, n_shards)
            client = member.connect_shard(self.shard_index)
            self.shard = CountedStore(client, tally, f"shard:{self.shard_index}")
            self.shard_waiter = KeyWaiter(member, client)
            self.shard_totals = shards.ShardTotals(counters, n_shards, self.weight)

    def close(self) -> None:
        """End the shard waiter's helper threads (the main store's waiter is the engine's)."""
        if self.shard_waiter is not None:
            self.shard_waiter.close()

    @property
    def waits(self) -> int:
        """Blocking key waits so far, on the main store and the shard (one round trip each)."""
        return self.waiter.gets + (self.shard_waiter.gets if self.shard_waiter else 0)

    def mark_skipped(self, tag: int | str, chain: Chain, settled: set[int]) -> None:
        """Decide 'redo' for every generation of the chain this rank moved past without reducing
        (`skip`). With a speaker the chain's `sync` skips each before reading the next entry, so
        this finds them settled."""
        for e in chain[:-1]:
            g = int(e["gen"])
            if g < int(chain[-1]["gen"]):
                self.skip(tag, g, settled)

    def skip(self, tag: int | str, g: int, settled: set[int]) -> None:
        """Decide 'redo' for generation g, which this rank moves past without reducing in it,
        unless it settled g already (reduced and decided, or skipped it before).

        Another position of the same generation may have completed its reduce; without this its
        ranks would wait for our outcome, while we wait for them inside an intra-replica
        collective of the next chain entry's microbatches. (Our position's reduce in that
        generation cannot have completed without us, so no commit can be lost.) With a speaker
        only it writes; every position agrees once per generation of the chain, here or in
        `decide`, before it reads the next chain entry (recovery/chain.py), so the replica's
        agreements pair up.
        """
        if g in settled:
            return
        settled.add(g)
        if self.link is not None:  # where a sibling reduced in g, it agrees with us now
            self.link.agree(g, False)  # (first: a failed write must not strand it)
        if self.counts:
            self._redo(keys.decision_key(tag, g))

    def _redo(self, dkey: str) -> bytes:
        """Decide `redo` (whatever was decided first is returned) and copy it to our shard,
        where its ranks may be waiting."""
        decided = self._put(dkey, keys.REDO)
        if self.shard is not None:
            keys.set_sealed(self.shard, self.token, dkey, decided)
        return decided

    def _put(self, dkey: str, value: bytes) -> bytes:
        """Write the decision once (sealed; a stranger's value there is replaced, never taken:
        `keys.put_once`); the decision that won."""
        try:
            return keys.put_once(self.store, self.token, dkey, value, keys.is_decision)
        except ValueError as e:
            raise RecoveryError(str(e)) from None

    def _accept(self, dkey: str) -> keys.Accept:
        """What a blocked read of the decision takes: an authentic decision value."""
        return keys.opener(self.token, dkey, keys.is_decision)

    def decide(self, step: int, tag: int | str, g: int, ok: bool,
               meanwhile: Callable[[], None] | None = None) -> bytes:
        """Commit iff every position of every surviving member of g holds a verified result;
        decided once, by compare-and-set of the attempt's decision key.

        Failure-free this costs two round trips: count our verified result; the rank whose
        count completes the set writes `commit` (or `commit-plan`), the others block on the
        decision. A failure writes `redo` at once (and returns whatever was decided first: the
        caller never applies a commit it holds no verified sum for, `CommitRefused`). If the
        membership changes while we wait (a member died, maybe after its reduce completed: its
        part is then inside the sum, as the trailer proves), the survivors decide on evidence
        instead: each counts itself once per newer generation it learns, and the rank whose count
        covers every surviving position writes `commit-plan`. `meanwhile()` runs at most once,
        while a verified rank's wait for the decision is out (work that applies nothing).
        """
        dkey = keys.decision_key(tag, g)
        if self.link is not None:
            return self._decide_as_replica(step, tag, g, ok, dkey, meanwhile)
        if not ok:
            return self._redo(dkey)
        return self._decide_counted(step, tag, g, dkey, meanwhile)

    def _decide_as_replica(self, step: int, tag: int | str, g: int, ok: bool, dkey: str,
                           meanwhile: Callable[[], None] | None) -> bytes:
        """`decide` with a speaker: agree inside the replica, then position 0 decides for all
        and shares the decision. A failed agreement is `redo` on every position (none of ours
        counted: g cannot commit with us; if it committed without us, we were evicted)."""
        assert self.link is not None
        if not self.link.agree(g, ok):
            if self.counts:
                self._redo(dkey)
            return keys.REDO
        if not self.counts:
            if meanwhile is not None:
                meanwhile()
            return self.link.share(None)
        return speak(self.link, lambda: self._decide_counted(step, tag, g, dkey, meanwhile))

    def _decide_counted(self, step: int, tag: int | str, g: int, dkey: str,
                        meanwhile: Callable[[], None] | None) -> bytes:
        """Count our verified result(s), then commit if ours completes the count, else wait."""
        if self.shard is not None:
            return self._decide_sharded(step, tag, g, dkey, meanwhile)
        total = len(self.member.members(g)) * self.positions
        if self.store.add(keys.count_key(tag, g, self.token), self.weight) == total:
            return self._put(dkey, self.commit_value(step, g))
        return self._await_decision(self.waiter, step, tag, g, dkey, meanwhile=meanwhile)

    def _decide_sharded(self, step: int, tag: int | str, g: int, dkey: str,
                        meanwhile: Callable[[], None] | None) -> bytes:
        """`decide` through this rank's store shard (control/shards.py): count there, then
        wait there; the rank completing its shard's count tells the coordinator (a line on its
        liveness socket, no round trip), which decides on the main store once every shard's
        count is complete and copies the decision into the shards. Two round trips, whoever
        we are."""
        assert self.shard_waiter is not None
        per_shard = self.shard_totals.of(g, self.member.members(g))
        counted = self.shard.add(keys.count_key(tag, g, self.token), self.weight)
        if counted == per_shard[self.shard_index]:
            self.member.tell(shards.counted_line(tag, g, self.shard_index, sorted(per_shard),
                                                 self.shard_totals.shards,
                                                 self.commit_value(step, g)))
        # Decided on evidence (the coordinator never completed the count), the decision is
        # copied here too: that ends our shard waiter's blocked get, so its client is reused,
        # not replaced by a new connection (each costs the server a blocking DNS lookup:
        # docs/MEASUREMENTS.md, "TCPStore").
        return self._await_decision(self.shard_waiter, step, tag, g, dkey, copy_to=self.shard,
                                    meanwhile=meanwhile)

    def _await_decision(self, waiter: KeyWaiter, step: int, tag: int | str, g: int, dkey: str,
                        copy_to: Any = None, meanwhile: Callable[[], None] | None = None
                        ) -> bytes:
        """Block on the decision; if the membership changes first, decide on evidence (and
        copy that decision into `copy_to`, a shard, if given)."""
        decided = waiter.get(dkey, g, 3 * self.timeout_s, meanwhile, self._accept(dkey))
        if keys.is_decision(decided):
            return decided
        if decided is not None:
            log.warning("step %s generation %d: unexpected decision value %r from the waiter; "
                        "reading it again", tag, g, decided)
        decided = self._decide_on_evidence(step, tag, g, dkey)
        if copy_to is not None:
            keys.set_sealed(copy_to, self.token, dkey, decided)
        return decided

    def _decide_on_evidence(self, step: int, tag: int | str, g: int, dkey: str) -> bytes:
        """Commit once every rank of the newest generation that was in g holds a verified result.

        Each such rank counts itself, once per generation it learns while it waits (one round
        trip: `evidence_key`); the rank whose count completes a generation's set writes the
        decision. A rank whose reduce failed never counts (it wrote `redo` at once), and a rank
        that counted and then died held a verified result too: so a commit never leaves a live
        rank without one. O(1) round trips per rank per membership change (reading every
        rank's outcome would be O(R x P) per rank). The decision
        names the generation counted (`_evidence_value`), so the next step's plan stays implied."""
        # A sibling position may legitimately take barrier + build + reduce (3 timeouts) first.
        deadline = Deadline(3 * self.timeout_s)
        counted = -1
        while True:
            seen = self.member.generation()
            if seen > counted:
                counted = seen
                live = set(self.member.members(seen)) & set(self.member.members(g))
                if self.store.add(keys.evidence_key(tag, g, seen, self.token),
                                  self.weight) == \
                        len(live) * self.positions:
                    return self._put(dkey, self._evidence_value(step, g, seen))
            left = deadline.left()
            if left <= 0:
                raise RecoveryError(f"no commit decision for step {tag} within "
                                    f"{3 * self.timeout_s:.0f}s")
            decided = self.waiter.get(dkey, seen, left, accept=self._accept(dkey))
            if keys.is_decision(decided):
                return decided
            if decided is not None:
                log.warning("step %s generation %d: unexpected decision value %r", tag, g,
                            decided)
            self.member.check()
            self.member.watch.progress()
            if self.member.generation() == seen:
                time.sleep(0.05)  # the wait ended on a store error, not a newer generation

    def _evidence_value(self, step: int, g: int, seen: int) -> bytes:
        """A commit on evidence counted in generation `seen`: `commit@{seen}`, so every rank
        implies the next step's plan for seen's members (each counted in seen, so each knows
        them; a speaker's sibling waits to learn seen: recovery/chain.py), unless the plan must
        be stored anyway (`commit_value`) or seen holds a replica g did not (one admitted
        since): then `commit-plan`. One request a survivor less per failure than storing it."""
        if not set(self.member.members(seen)) <= set(self.member.members(g)):
            return keys.COMMIT_PLAN
        value = self.commit_value(step, seen)
        return keys.commit_at(seen) if value == keys.COMMIT else value
