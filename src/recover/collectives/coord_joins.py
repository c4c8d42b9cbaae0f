"""The coordinator's admissions: replicas joining mid-run, and a restarted coordinator resuming.

Invariants (with those of `recover.collectives.coordinator`, whose state this mixin shares):
- A joiner becomes a member only in a new generation published after every one of its ranks
  reported a verified state from a donor (`ready`); a join given up publishes a generation too,
  so whoever paused a step for it goes on.
- A restarted coordinator (`--recover`) publishes its first generation only from what the
  re-registered replicas hold (`admission.resume_plan`): the run resumes at the highest step a
  replica holds whole, numbered after every generation any rank knew; every other replica is
  healed by a state transfer before it is a member again.
"""

from __future__ import annotations

import time
from typing import Any

from recover.collectives import keys
from recover.collectives.admission import Join, Member, resume_plan


class Admissions:
    """Mixin of `Coordinator`: the join and resume rules (see the module docstring)."""

    # Declared for type checkers; `Coordinator.__init__` sets them.
    joins: dict[int, Join]
    replicas: dict[int, Any]
    members: list[int]
    generation: int
    epochs: int
    expected: int
    stale_s: float
    join_timeout_s: float
    started: float
    client: Any
    heard: dict[int, Any]
    exits: dict[int, str]
    lost: dict[int, str]
    _conns: dict[int, Any]
    _resume: dict[int, dict[int, int]]
    _newest_seen: int
    _join_at: dict[int, int]
    _last_hello: float
    _floor: int

    def _announce_join(self, replica: int, join: Join) -> None:
        self.epochs += 1
        join.epoch, join.ready, join.since = self.epochs, set(), time.monotonic()
        self._log({"event": "join", "replica": replica, "epoch": join.epoch})
        for c in list(self._conns.values()):
            if c.replica == replica:
                self._send(c, f"joining {join.epoch} {self.generation} {self._floor}\n")
            elif c.replica in self.members:
                self._send(c, f"join {replica} {join.epoch} {join.at}\n")

    def _join_ready(self, conn: Any, epoch: int) -> None:
        join = self.joins.get(conn.replica)  # type: ignore[arg-type]
        if join is None or join.epoch != epoch:
            return
        join.ready.add(conn.rank)
        if len(join.ready) == join.nranks:
            replica = conn.replica
            del self.joins[replica]  # type: ignore[arg-type]
            self.replicas[replica] = Member(join.nranks, set(join.ranks))  # type: ignore[index]
            self._set_exit(replica, "running")  # type: ignore[arg-type]
            self._publish(sorted({*self.members} - set(self.lost) | {replica}),
                          f"replica {replica} admitted (join {epoch})")
            self._end_join(epoch)

    def _join_failed(self, replica: int | None, epoch: int, why: str) -> None:
        join = self.joins.get(replica) if replica is not None else None  # type: ignore[arg-type]
        if join is None or join.epoch != epoch:
            return
        self._log({"event": "join-failed", "replica": replica, "epoch": epoch, "why": why})
        # Whoever paused a step for this join goes on without it: a new generation.
        self._publish([m for m in self.members if m not in self.lost],
                      f"join of replica {replica} given up ({why})")
        self._end_join(epoch)
        join.epoch = -1
        if len(join.ranks) == join.nranks:  # still connected: another donor, another boundary
            self._announce_join(replica, join)  # type: ignore[arg-type]

    def _end_join(self, epoch: int) -> None:
        for c in list(self._conns.values()):
            if c.replica in self.members:
                self._send(c, f"joinend {epoch}\n")

    def _maybe_resume(self, now: float) -> None:
        """--recover: once every replica re-registered, or none for 2 x stale_s, resume at the
        highest step a replica holds whole; heal the others by state transfer (admission.
        resume_plan). Generations continue after the newest any rank knew, so nothing of the
        dead coordinator's generations can be mistaken for this one's."""
        complete = sorted(r for r, rep in self.replicas.items() if len(rep.ranks) >= rep.nranks)
        quiet = now - self._last_hello > 2 * self.stale_s
        timed_out = now - self.started > self.join_timeout_s
        if not (len(complete) >= self.expected or (complete and quiet) or timed_out):
            return
        plan = resume_plan({r: self._resume[r] for r in complete})
        if plan is None:
            why = (f"restarted coordinator: no replica holds a whole step to resume from "
                   f"(re-registered: {self._resume})")
            self.client.set(keys.COORD_ERROR, why)
            self._log({"event": "resume-failed", "why": why})
            self.generation, self.members = 0, []
            return
        step, members, heal = plan
        self._floor = max(self._newest_seen + 1, 0)
        self.generation = self._floor - 1  # _publish makes _floor
        for conn in self.heard.values():  # silence is judged from now on
            conn.heard = now
        for conn in list(self._conns.values()):
            if conn.replica in members:
                self._send(conn, f"welcome {self._floor}\n")
        self._publish(members, f"coordinator restarted: resuming at step {step}; replicas "
                               f"{heal} are healed by state transfer")
        self._log({"event": "resumed", "step": step, "members": members, "heal": heal,
                   "registered": {str(r): a for r, a in self._resume.items()}})
        self.exits.update({r: "running" for r in members})
        self._write_exits()
        for r in sorted(self._resume):  # incomplete ones join when their last rank arrives
            if r in members:
                continue
            rep = self.replicas.pop(r)
            join = self.joins[r] = Join(rep.nranks, ranks=set(rep.ranks),
                                        at=max(step, self._join_at.get(r, 0)))
            self._set_exit(r, "joining")
            if r in heal:
                self._announce_join(r, join)

