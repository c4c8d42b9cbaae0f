"""Store shards: the step decision's counting spread over several store servers.

One TCPStore server handles every request one after another on one thread (its CPU per request:
docs/MEASUREMENTS.md, "TCPStore"; `bench/_store_rate.py`), so a step that costs each of G ranks
two requests costs the server 2 G of them: seconds a step at 100,000 ranks, however few each rank
makes. With
`--store-shards S` the coordinator also hosts S shard servers (each its own libuv thread, so they
run on S cores), and a failure-free step's count and decision go through a two-level tree:

- rank (replica m, position p) counts on shard `(m * P + p) % S` (its *shard*) and then waits
  there for the decision (a blocking get): two round trips, whoever it is; a multi-rank replica
  with a speaker (recovery/decide.py) counts as one rank of weight P on shard `m % S`;
- the rank whose add completes its shard's set is that shard's *leader* for the attempt: it tells
  the coordinator so on its liveness socket (`counted`, a line, no store request); the
  coordinator (`TreeTop`), once every shard that has ranks of the generation has told it,
  decides on the main store (compare-and-set, written once, as with one store) and copies the
  main store's decision into each of those shards, where their ranks wait;
- a rank whose reduce failed writes `redo` on the main store and copies what is there into its
  own shard.

Invariant: a shard's decision key only ever holds a copy of the main store's decision key (which
is written once), so every rank reads the one decision, whichever store it reads it from. A
shard's ranks that are left waiting (their leader died before it told the coordinator, or their
count can never complete) are woken by the newer generation that a death publishes, and then
decide on evidence through the main store, as with one store. Work per step: 2 requests per rank
on its shard; the coordinator's 1 on the main store (the decision) and 1 per shard (its copy).
The coordinator owns the main store and the shards (the same process): relaying through it adds
no failure mode, since its death ends the stores too.

The cross-replica communicators meet on the shards too: every group of position p (its barrier,
its gloo addresses, gloo's own address exchange) on shard `p % S`, a function of the position
alone, so every member of a group picks the same shard (a joiner, and a rank that skipped
generations, too), and knows it before any generation exists. The main store then serves none of
a rebuild's lookups (O(1) per member: collectives/meshstore.py).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from recover.control import keys


def shard_of(replica: int, position: int, positions: int, shards: int) -> int:
    """The shard a rank counts on."""
    return (replica * positions + position) % shards


def rendezvous_shard(position: int, shards: int) -> int:
    """The shard where the communicators of `position` meet (see the module's docstring)."""
    return position % shards


def totals(members: Iterable[int], positions: int, shards: int) -> dict[int, int]:
    """{shard: ranks of `members` counting on it}, only the shards that have any."""
    out: dict[int, int] = {}
    for m in members:
        for p in range(positions):
            s = shard_of(m, p, positions, shards)
            out[s] = out.get(s, 0) + 1
    return out


def parse_ports(raw: bytes) -> list[int] | None:
    """The ports in an opened `coord/shards` value (the coordinator writes `[]` for none, so a
    member tells "no shards" from a stranger's value, absent to it); None when it is not a
    list of ports."""
    try:
        ports = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(ports, list) or len(ports) > 4096 or \
            not all(type(p) is int and 0 < p < 65536 for p in ports):
        return None
    return ports


class ShardTotals:
    """Per generation: the count each shard completes at (its counting ranks x `weight`, what
    each adds: P for a replica's speaker), and which shards count at all (cached: O(R P) once a
    generation, not once a step)."""

    def __init__(self, positions: int, shards: int, weight: int = 1) -> None:
        self.positions, self.shards, self.weight = positions, shards, weight
        self._by_gen: dict[int, dict[int, int]] = {}

    def of(self, g: int, members: list[int]) -> dict[int, int]:
        t = self._by_gen.get(g)
        if t is None:
            if len(self._by_gen) > 8:
                self._by_gen.clear()
            t = self._by_gen[g] = {s: n * self.weight for s, n in
                                   totals(members, self.positions, self.shards).items()}
        return t


TAG = re.compile(r"\d+(\.\d+)?")  # a step's name in the store: `t`, or `t.round` (exact mode)
OPEN_MAX = 256  # attempts whose shards have not all told the coordinator, kept at most


def counted_line(tag: int | str, g: int, shard: int, used: list[int], shards: int,
                 value: bytes) -> str:
    """A shard leader's liveness line: shard `shard`'s count of attempt (tag, g) is complete;
    `used` are the shards with ranks of g (`all`: every one of the `shards`); `value` is the
    decision a commit writes (`commit` or `commit-plan`)."""
    which = "all" if len(used) == shards else ",".join(map(str, used))
    return f"counted {tag} {g} {shard} {which} {value.decode()}\n"


class TreeTop:
    """The coordinator's side of the count tree: it hears each shard's leader and, once every
    shard that has ranks of the generation has been heard, writes the decision on the main store
    (compare-and-set: a `redo` already there wins) and copies what is there into those shards.

    `main` is the coordinator's main-store client, `servers` its shard servers (each one's own
    client is used: no new connection). Every call is on the coordinator's loop thread."""

    def __init__(self, main: Any, servers: list[Any], token: str | None = None) -> None:
        self.main, self.servers, self.token = main, servers, token
        # (tag, g) -> (shards heard, any said commit-plan), oldest first
        self._open: OrderedDict[tuple[str, int], tuple[set[int], bool]] = OrderedDict()

    def counted(self, words: list[str]) -> bytes | None:
        """`counted <tag> <g> <shard> <used> <value>` (words after the first): the decision,
        once this completes the set; None before. ValueError on a malformed line."""
        tag, g, shard, which, value = words[0], int(words[1]), int(words[2]), words[3], words[4]
        n = len(self.servers)
        used = set(range(n)) if which == "all" else {int(k) for k in which.split(",")}
        if not TAG.fullmatch(tag) or g < 0 or shard not in used or not used <= set(range(n)) \
                or value.encode() not in keys.COMMITS:
            raise ValueError(f"counted: {' '.join(words)[:100]!r}")
        heard, plan = self._open.pop((tag, g), (set(), False))
        heard.add(shard)
        # Any leader that saw a reason to store the next plan (a join waits) makes it so.
        plan = plan or value.encode() == keys.COMMIT_PLAN
        if len(heard) < len(used):
            self._open[(tag, g)] = (heard, plan)
            while len(self._open) > OPEN_MAX:  # attempts that never complete (a failure)
                self._open.popitem(last=False)
            return None
        dkey = keys.decision_key(tag, g)
        decided = keys.put_once(self.main, self.token, dkey,
                                keys.COMMIT_PLAN if plan else keys.COMMIT, keys.is_decision)
        for k in sorted(used):
            keys.set_sealed(self.servers[k], self.token, dkey, decided)
        return decided
