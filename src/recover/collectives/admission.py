"""Who the coordinator hears, and whom evidence convicts: its pure rules, apart from its loop.

Invariants:
- `refusal` accepts a hello only with valid ids, the run's token (when the run has one), the
  run's config fingerprint (when known) and no live connection for the same (replica, rank);
  anything else gets one readable reason, and changes nothing.
- `convicted` names a member only on evidence others corroborate: the member named by the most
  distinct reporters, if at least two name it, or if one uncontested reporter does; never a
  reporter for reporting, and nobody on a tie of one against one.
- `resume_plan` lets a restarted coordinator resume only from a step some replica holds whole
  (every rank at it), the highest such; every other replica is healed to it by state transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Hello:
    """hello <replica> <rank> <nranks> <pid> [<token> <fingerprint> [<join at step>
    [<steps applied> <generation>]]]: the last two from a process that was running when its
    coordinator died (-1 otherwise), so a restarted coordinator can resume the run."""

    replica: int
    rank: int
    nranks: int
    pid: int
    token: str = "-"
    fingerprint: str = "-"
    join_at: int = 0
    applied: int = -1
    generation: int = -1

    @classmethod
    def parse(cls, words: list[str]) -> Hello:
        """Raises ValueError or IndexError on a malformed line (the caller logs and drops it)."""
        replica, rank, nranks, pid = (int(w) for w in words[1:5])
        return cls(replica, rank, nranks, pid, words[5] if len(words) > 5 else "-",
                   words[6] if len(words) > 6 else "-", int(words[7]) if len(words) > 7 else 0,
                   int(words[8]) if len(words) > 8 else -1,
                   int(words[9]) if len(words) > 9 else -1)


def refusal(h: Hello, expected: int, token: str | None, fingerprint: str | None,
            connected: bool, known_nranks: int | None) -> str | None:
    """Why a hello is refused (None: accepted). `connected`: a live connection already speaks
    for (replica, rank); `known_nranks`: the replica's rank count as a member, if it is one."""
    if not (0 <= h.replica < expected and h.nranks >= 1 and 0 <= h.rank < h.nranks):
        return f"replica {h.replica} rank {h.rank}/{h.nranks} is outside this run's {expected}"
    if token is not None and h.token != token:
        return "wrong run token (another run's worker, or RECOVER_RUN_TOKEN is not this run's)"
    if fingerprint not in (None, "-") and h.fingerprint not in ("-", fingerprint):
        return ("its config differs from this run's (seed, N, model, data or optimizer): "
                "a worker of another run")
    if connected:
        return f"replica {h.replica} rank {h.rank} is already connected"
    if known_nranks is not None and known_nranks != h.nranks:
        return f"replica {h.replica} has {known_nranks} ranks, not {h.nranks}"
    return None


def convicted(accusations: dict[int, set[int]]) -> list[int]:
    """The members the evidence convicts (accused -> the reporters who named it)."""
    top = max((len(a) for a in accusations.values()), default=0)
    guilty = [r for r, a in accusations.items() if len(a) == top]
    if top >= 2:
        return guilty
    if top == 1 and len(guilty) == 1:
        (accuser,) = accusations[guilty[0]]
        if not accusations.get(accuser):  # uncontested: nobody named the one who named it
            return guilty
    return []


@dataclass
class Member:
    """A member replica as the coordinator knows it: its rank count and connected ranks."""

    nranks: int
    ranks: set[int] = field(default_factory=set)


@dataclass
class Join:
    """A replica being admitted mid-run: its ranks' hellos, then their verified states."""

    nranks: int
    epoch: int = -1
    ranks: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    since: float = field(default_factory=time.monotonic)
    at: int = 0  # not before this step boundary


def resume_plan(applied: dict[int, dict[int, int]]) -> tuple[int, list[int], list[int]] | None:
    """A restarted coordinator's first generation, from what each complete replica's ranks
    say they applied (replica -> rank -> optimizer steps; -1: a process that holds no run state).

    Returns (step the run resumes at, members, replicas to heal), or None if no replica can
    resume. Members are the replicas whose ranks all hold the same step, the highest such; every
    other replica (behind, ahead of it, or with ranks that disagree) is healed by a state
    transfer from a member, which overwrites its whole state, so no step is lost or applied twice
    whichever side of the commit each rank was on when the coordinator died.
    """
    whole = {r: next(iter(set(a.values()))) for r, a in applied.items()
             if len(set(a.values())) == 1 and min(a.values()) >= 0}
    if not whole:
        return None
    step = max(whole.values())
    members = sorted(r for r, a in whole.items() if a == step)
    return step, members, sorted(r for r in applied if r not in members)
