"""Who the coordinator hears, and whom evidence convicts: its pure rules, apart from its loop.

Invariants:
- `refusal` accepts a hello only with valid ids, proof of the run's token (when the run has one:
  `proof(token)`, never the token itself, so any characters work and the secret is not sent), the
  run's config fingerprint (when known) and no live connection for the same (replica, rank);
  anything else gets one readable reason, and changes nothing.
- `convicted` names a member only on evidence that tells a lost member from a slow one: named by
  another member and its own main thread stalled (its heartbeats say so), or named by at least
  two others while it named every other member itself (it reaches nobody: a partition). Being
  late at a barrier alone convicts nobody, however many name it; a reporter is never convicted
  for reporting.
- `cut_off` evicts on data-path evidence (a member's handshake to another failed as a cut
  fails, `control.reach`) the fewest members that leave every pair of the rest able to
  reach each other, greedily: first the member the most others cannot reach, among equals the
  one that reported later (or never), then the higher id. Of two that only name each other
  exactly one goes, never both, whatever order the reports come in.
- `resume_plan` lets a restarted coordinator resume only from a step some replica holds whole
  (every rank at it), the highest such; every other replica is healed to it by state transfer.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field


def proof(token: str | None, purpose: str = "recover-hello") -> str:
    """What a member shows for the run's token: hex HMAC-SHA256(token, purpose) ("-": no token).
    One word whatever the token holds (the hello is split on whitespace), and a listener that
    reads it learns nothing it could use for another purpose (another `purpose`: another key)."""
    if not token:
        return "-"
    return hmac.new(token.encode(), purpose.encode(), hashlib.sha256).hexdigest()


@dataclass
class Hello:
    """hello <replica> <rank> <nranks> <pid> [<proof of the token> <fingerprint> [<join at step>
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
    if token is not None and not hmac.compare_digest(h.token.encode(), proof(token).encode()):
        return "wrong run token (another run's worker, or RECOVER_RUN_TOKEN is not this run's)"
    if fingerprint not in (None, "-") and h.fingerprint not in ("-", fingerprint):
        return ("its config differs from this run's (seed, N, model, data or optimizer): "
                "a worker of another run")
    if connected:
        return f"replica {h.replica} rank {h.rank} is already connected"
    if known_nranks is not None and known_nranks != h.nranks:
        return f"replica {h.replica} has {known_nranks} ranks, not {h.nranks}"
    return None


def convicted(accusations: dict[int, set[int]], members: list[int] | set[int],
              stalled: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The members the evidence convicts. `accusations`: accused -> the members that named it;
    `stalled`: members whose heartbeats report a main thread stalled inside the step protocol.

    Naming alone is not enough: a member late at a communicator's barrier may be slow (a long
    microbatch, a stalled store call, a loaded host) rather than lost, and a slow member catches
    up. Evicting it would shrink the job for nothing, and evict a healthy replica on one
    impatient survivor's word (docs/MEASUREMENTS.md, "Liveness and detection").
    """
    named_by: dict[int, set[int]] = {}  # reporter -> whom it named
    for accused, accusers in accusations.items():
        for a in accusers:
            named_by.setdefault(a, set()).add(accused)
    guilty = []
    for x, accusers in accusations.items():
        others = set(accusers) - {x}
        if not others:
            continue
        isolated = named_by.get(x, set()) >= set(members) - {x}
        if x in stalled or (len(others) >= 2 and isolated):
            guilty.append(x)
    return sorted(guilty)


def cut_off(cuts: dict[int, set[int]], reported: list[int], members: list[int] | set[int],
            gone: set[int] | frozenset[int] = frozenset(),
            since: dict[int, int] | None = None) -> list[int]:
    """The members to evict so the rest reach each other. `cuts`: reporter -> the members its
    data path cannot reach; `reported`: reporters in the order their first report came; `gone`:
    members already being evicted (their cuts need nothing more, so a decision only ever grows);
    `since`: the generation each member was admitted in (absent: 0).

    A cut is symmetric (a handshake crosses both ways), so a naming counts from either end. The
    side that more others reach stays: it keeps more of the data path whole; between two
    that only name each other the one admitted earlier stays (a replacement that cannot reach
    the member it joined, on a path that member used until then, is the likelier broken end:
    otherwise a restarted, still-partitioned replica evicts the healthy incumbent),
    then the first reporter, the one whose evidence came first (deterministic, and known when
    the first report comes: no waiting for the other side).
    """
    admitted = since or {}
    edges = {frozenset((a, b)) for a, named in cuts.items() for b in named
             if a != b and {a, b} <= set(members) and not {a, b} & gone}
    order = {r: i for i, r in enumerate(reported)}
    evicted: list[int] = []
    while edges:
        degree: dict[int, int] = {}
        for e in edges:
            for v in e:
                degree[v] = degree.get(v, 0) + 1
        victim = max(degree, key=lambda v: (degree[v], admitted.get(v, 0),
                                            order.get(v, len(order)), v))
        evicted.append(victim)
        edges = {e for e in edges if victim not in e}
    return sorted(evicted)


@dataclass
class Registration:
    """A replica as the coordinator knows it (a member, or one re-registering with a restarted
    coordinator): its rank count and its connected ranks."""

    nranks: int
    ranks: set[int] = field(default_factory=set)


@dataclass
class Join:
    """A replica being admitted mid-run: its ranks' hellos, then their verified states."""

    nranks: int
    epoch: int = -1
    ranks: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    donated: set[int] = field(default_factory=set)  # ranks whose donor confirmed (`donated`)
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
