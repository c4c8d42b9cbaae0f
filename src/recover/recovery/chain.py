"""The ownership chain of a step: which live replica owns each of its ids, agreed in the store.

Invariants:
- Entry k of step t's chain (`step/{t}/chain/{k}`) is written once, by compare-and-set: entry 0
  is the plan (or the admission of a joiner at the step boundary), entry k > 0 hands the ids of
  replicas missing from generation g_k to the survivors. Every rank reads the same chain, so
  nobody double-counts or drops an id even if replicas saw different generations.
- Entry 0 of step t+1 is *implied*, not stored, when step t's decision is `commit` or
  `commit@{s}` (not `commit-plan`): it is then the plan of the generation t committed in (of s,
  after a commit on evidence counted in s, recovery/decide.py), for the speeds in t's reduced
  trailer, facts every rank of step t+1 holds alike (it read that one decision). A joiner or a
  fresh engine only ever starts at a stored entry 0, because whoever writes a decision while a
  join is pending writes `commit-plan` (`commit_value`).
- What an entry assigns is the `StepStrategy`'s answer, a pure function of the chain before it,
  the members and the speeds, so whoever writes it, everyone would have written the same.
- An entry read from the store is checked against the step's definition before it is used
  (`entry_problem`): ids of `step_ids(t, N)` only, each at most once in the entry, owners that
  are replica ids, and (for a strategy that keeps work) every id of the step owned exactly once
  once the chain holds a plan. With a run token it is also sealed (control/sealed.py). An
  entry that fails either is absent: readers wait past it, the proposer replaces it; it never
  decides what is trained (a forged entry naming step 0's ids, say, is never trained).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from recover.control import Member, keys, sealed
from recover.control.waiter import KeyWaiter
from recover.deadline import Deadline
from recover.recovery.failures import RecoveryError
from recover.recovery.speaker import ReplicaLink, speak
from recover.recovery.strategy import Chain, StepStrategy
from recover.settings import MAX_REPLICAS, FaultTolerance, Hooks
from recover.workload import step_ids


class OwnershipChain:
    """One rank's reader and writer of the chains of successive steps.

    `speeds` (every replica's seconds per microbatch, from the last reduced trailer) feed the
    plans; `shared_speeds` says whether every rank of a replica holds the same ones (one rank per
    replica, or a caller that makes them agree): only then may a speed-aware plan be implied.
    `link`: a multi-rank replica's `ReplicaLink`; its position 0 then reads the chain for all
    its positions (`sync`).
    """

    def __init__(self, member: Member, store: Any, waiter: KeyWaiter, strategy: StepStrategy,
                 n: int, position: int, positions: int, ft: FaultTolerance,
                 hooks: Hooks, link: ReplicaLink | None = None) -> None:
        self.member, self.store, self.waiter = member, store, waiter
        self.link = link if positions > 1 else None  # a speaker reads the chain for its replica
        self.strategy, self.n = strategy, n
        self.me, self.position, self.positions = member.replica, position, positions
        self.timeout_s, self.speed_aware = ft.reduce_timeout_s, ft.speed_aware
        self.hooks = hooks  # fault injection's scheduled joins (replica -> step)
        self.token = getattr(member, "token", None)  # seals the entries (control/sealed)
        self.shared_speeds = positions == 1
        self.speeds: dict[int, float] = {}
        self._proposed: set[int] = set()  # join epochs this rank proposed an admission for
        # (tag, generation): that step's plan is implied by the commit of the step before it in
        # that generation (see the module docstring); None: the next plan is read from the store.
        self._implied: tuple[int | str, int] | None = None
        self.first_implied = False  # the last chain begun had its entry 0 implied, not stored

    def committed(self, step: int, g: int, decision: bytes) -> None:
        """Step `step` committed in generation g with `decision`: a plain `commit` implies the
        next step's entry 0 for g's members, a commit on evidence (`commit@{s}`) for s's."""
        implied = keys.implied_generation(decision, g)
        self._implied = (step + 1, implied) if implied is not None else None

    def predict(self, step: int, g: int, speeds: dict[int, float]) -> list[int]:
        """The ids this replica computes in step `step` if its entry 0 is implied by a commit in
        g with `speeds`: what it most likely computes next. A guess for a prefetch, never a plan
        (a `redo`, `commit-plan` or fault makes another)."""
        return list(self._assign(step, [], self.member.members(g), speeds).get(self.me, []))

    def sync(self, step: int, tag: int | str, chain: Chain, g: int, members: list[int],
             moved_past: Callable[[int], None] | None = None) -> Chain:
        """Read the agreed chain up to an entry of generation >= g, extending it if nobody has
        yet. Entry 0, the step's plan, is proposed by one rank (position 0 of the lowest member);
        the others block on it. Later entries (after a fault) are proposed by whoever needs them
        first. Entry 0 is implied instead when the last commit says so.

        With a speaker (`link`), position 0 alone reads or writes each entry in the store and
        shares it with its siblings, and a call adds at most one entry (a stored one, or the
        implied entry 0): its positions compute that entry's new microbatches together (their
        intra-replica collectives pair up) before any of them enters the link again, so none
        waits in the link while a sibling waits in a collective of a microbatch. A position
        whose view of the generation runs ahead extends again at its next attempt. Before an
        entry after the first, every position calls `moved_past` with the generation of the
        entry before (its agreement there, unless it reduced and decided in it:
        recovery/decide.py): each position's link calls pair up in chain order, an entry's share,
        then its generation's agreement."""
        chain = list(chain)
        implied, self._implied = self._implied, None
        if not chain:
            self.first_implied = implied is not None and implied[0] == tag
        if not chain and implied is not None and implied[0] == tag:
            chain.append(self._plan_entry(step, implied[1], self._members_of(implied[1])))
            if self.link is not None:
                return chain  # one entry a call (see above)
        deadline = Deadline(3 * self.timeout_s)

        def learn() -> bytes:  # the next entry from the store (the membership may change)
            nonlocal g, members
            raw, g, members = self._read(step, tag, chain, g, members, deadline)
            return raw

        def past() -> None:  # agree on the generation we move past (recovery/decide.py)
            if chain and moved_past is not None:
                moved_past(int(chain[-1]["gen"]))

        def past_and_learn() -> bytes:  # a speaker's: its store errors reach its siblings too
            past()
            return learn()

        if self.link is not None:
            if chain and chain[-1]["gen"] >= g:
                return chain
            if self.position == 0:
                raw = speak(self.link, past_and_learn)
            else:
                past()
                raw = self.link.share(None)  # its speaker's entry: it asks the store nothing
            return [*chain, self._decoded(step, chain, raw)]
        while not chain or chain[-1]["gen"] < g:
            chain.append(self._decoded(step, chain, learn()))
        return chain

    def _decoded(self, step: int, chain: Chain, raw: bytes) -> dict:
        """An entry `_read` (or a speaker) returned: checked already, but a speaker's sibling
        checks again what its link carried (one more parse, no request)."""
        entry, why = self._parsed(step, chain, raw)
        if why is not None:  # unreachable for what `_read` returned
            raise RecoveryError(f"step {step} chain entry {len(chain)}: {why}")
        return entry

    def _parsed(self, step: int, chain: Chain, raw: bytes) -> tuple[dict, str | None]:
        """`raw` as entry len(chain) of step `step`'s chain, and why it is not one (None: it is)."""
        try:
            entry = json.loads(raw)
        except ValueError:
            entry = None
        return entry, entry_problem(entry, step, self.n, chain, self._replicas(),
                                    self.strategy.keeps_work)

    def _replicas(self) -> int:
        return getattr(self.member, "replicas", 0) or MAX_REPLICAS

    def _valid(self, step: int, chain: Chain, key: str) -> keys.Check:
        """Whether an opened value is a well-formed entry len(chain) of step `step`'s chain (at
        `key`, named when it is not)."""
        def valid(raw: bytes) -> bool:
            why = self._parsed(step, chain, raw)[1]
            if why is not None:
                sealed.rejected(key, why)
            return why is None
        return valid

    def _read(self, step: int, tag: int | str, chain: Chain, g: int, members: list[int],
              deadline: Deadline) -> tuple[bytes, int, list[int]]:
        """Entry len(chain) of the chain as stored, writing our proposal if we propose it, else
        waiting for it; with the generation and members it was read at (the membership may
        change meanwhile: then we may propose it)."""
        key = keys.chain_key(tag, len(chain))
        token, valid = self.token, self._valid(step, chain, key)
        while True:
            proposer = bool(chain) or (self.position == 0 and self.me == min(members))
            if proposer:
                mine = json.dumps(self._propose(step, chain, g, members))
                try:  # a stranger's value there is replaced (keys.put_once), never used
                    raw = keys.put_once(self.store, token, key, mine, valid)
                except ValueError as e:
                    raise RecoveryError(f"step {step}: {e}") from None
                return raw, g, members
            raw = self.waiter.get(key, g, deadline.left(), accept=keys.opener(token, key, valid))
            if raw is not None:
                return raw, g, members
            self.member.check()  # the membership changed meanwhile: maybe we propose now
            if deadline.passed():
                raise RecoveryError(f"no plan for step {step} within {3 * self.timeout_s:.0f}s")
            g = self.member.generation()
            members = self.member.members(g)

    def _members_of(self, g: int) -> list[int]:
        """Generation g's members for an implied plan. After a commit on evidence counted in g
        (`commit@{g}`) a speaker's sibling, told the decision through the replica's link, may
        not have learned g yet: it waits for the coordinator's push (bounded), then reads them
        from the store if the push skipped g (written before it was published: keys.py)."""
        with contextlib.suppress(KeyError):
            return self.member.members(g)
        if self.member.generation() < g:
            self.member.wait_newer(g - 1, 3 * self.timeout_s)
            with contextlib.suppress(KeyError):
                return self.member.members(g)
        members = keys.generation_members(self.store, g, self.token)
        if members is None:
            raise RecoveryError(f"generation {g}'s members are not in the store")
        return members

    def commit_value(self, step: int, g: int) -> bytes:
        """`commit` lets every rank imply step + 1's plan; `commit-plan` sends it through the
        store: when a joiner waits (its admission is a stored entry 0), when the fault injection
        schedules one at step + 1, or when speeds differ between a replica's ranks."""
        members = self.member.members(g)
        joins = any(r not in members for r in dict(self.member.join_requests))
        scheduled = any(at == step + 1 and r not in members
                        for r, at in self._scheduled().items())
        alike = self.shared_speeds or not self.speed_aware
        return keys.COMMIT if alike and not joins and not scheduled else keys.COMMIT_PLAN

    def _propose(self, step: int, chain: Chain, g: int, members: list[int]) -> dict:
        if not chain:
            self._await_scheduled_join(step, members)
        # A copy (one C-level operation): the liveness thread adds and removes entries.
        waiting = sorted(dict(self.member.join_requests).items(), key=lambda kv: kv[1]) \
            if not chain else []
        for joiner, (epoch, at) in waiting:  # one join per boundary, oldest first
            if joiner not in members and epoch not in self._proposed and step >= at:
                # Admit at this boundary: the step waits for the joiner (see StepEngine.run),
                # served by us.
                self._proposed.add(epoch)
                return {"gen": g, "assign": {},
                        "join": {"replica": joiner, "epoch": epoch, "donor": self.me}}
        return self._plan_entry(step, g, members, chain)

    def _plan_entry(self, step: int, g: int, members: list[int], chain: Chain | None = None
                    ) -> dict:
        """The chain entry after `chain` in generation g, as stored (JSON-shaped)."""
        assign = self._assign(step, chain or [], members, self.speeds)
        return {"gen": g, "assign": {str(m): ids for m, ids in assign.items() if ids}}

    def _assign(self, step: int, chain: Chain, members: list[int], speeds: dict[int, float]
                ) -> dict[int, list[int]]:
        """The strategy's answer for the entry after `chain`, with the members' known speeds
        (none when quotas are not speed-aware)."""
        known = {m: speeds[m] for m in members if m in speeds} if self.speed_aware else None
        return self.strategy.assign(step, self.n, chain, members, known)

    def _scheduled(self) -> dict[int, int]:
        """The scheduled joins (fault injection) whose replacement this process has not seen."""
        return {r: at for r, at in self.hooks.scheduled_joins.items()
                if r not in self.hooks.seen_joins}

    def _await_scheduled_join(self, step: int, members: list[int]) -> None:
        """Fault injection (`restart:replica=R,step=S`): at boundary S the plan waits, bounded,
        for replica R's replacement to register, so the scenario is reproducible. A real
        replacement is not waited for: it joins at the first boundary after it registered."""
        for replica, at in self._scheduled().items():
            if step >= at and replica in members:  # its replacement was admitted
                self.hooks.seen_joins.add(replica)
            if step != at or replica in members:
                continue
            # Shorter than the others' wait for this plan (3 x timeout): if the replacement
            # never registers (it died too), they get a plan without it, not a timeout.
            deadline = Deadline(self.timeout_s)
            while not deadline.passed() and not self.member.coordinator_lost:
                if replica in self.member.join_requests:
                    self.hooks.seen_joins.add(replica)
                    return
                self.member.watch.progress()
                deadline.sleep(0.01)


def entry_problem(entry: Any, step: int, n: int, chain: Chain, replicas: int,
                  keeps_work: bool) -> str | None:
    """Why `entry` cannot be entry len(chain) of step `step`'s chain (None: it can).

    What any honest writer's entry satisfies, whoever wrote it: `gen` a generation; `assign`
    maps replica ids (< `replicas`) to ids of `step_ids(step, n)`, none twice in the entry; a
    join admission only as entry 0, assigning nothing; and, for a strategy that keeps work
    (recover's), once the chain holds a plan every id of the step has exactly one owner (the
    plan names each once; a later entry only hands some to other replicas). So a chain that
    passes makes the reduce's expected ids exactly the step's (recovery/step.py)."""
    if not isinstance(entry, dict) or type(entry.get("gen")) is not int or entry["gen"] < 0:
        return "not a chain entry"
    assign = entry.get("assign")
    if not isinstance(assign, dict):
        return "no assignment"
    lo, hi = step * n, step * n + n  # step_ids(step, n), as a range
    seen: set[int] = set()
    for owner, ids in assign.items():
        if not (isinstance(owner, str) and owner.isdigit() and int(owner) < replicas):
            return f"owner {owner!r} is not a replica id"
        if not isinstance(ids, list) or not all(type(i) is int and lo <= i < hi for i in ids):
            return f"replica {owner}'s ids are not ids of step {step}"
        if seen & set(ids) or len(set(ids)) != len(ids):
            return "an id is assigned twice"
        seen |= set(ids)
    if "join" in entry:
        join = entry["join"]
        if chain or assign or not isinstance(join, dict) or \
                not all(type(join.get(k)) is int and join[k] >= 0
                        for k in ("replica", "epoch", "donor")):
            return "not a join admission"
        return None
    if keeps_work:
        owned = {i for e in chain for v in e["assign"].values() for i in v} | seen
        if owned != set(step_ids(step, n)):
            return f"does not leave every id of step {step} owned exactly once"
    return None
