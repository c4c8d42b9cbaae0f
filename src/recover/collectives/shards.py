"""Store shards: the step decision's counting spread over several store servers.

One TCPStore server handles every request one after another on one thread (measured 17.5 us of
its CPU per request, `bench/_store_rate.py`), so a step that costs each of G ranks two requests
costs the server 2 G of them: 3.5 s a step at 100,000 ranks, however few each rank makes. With
`--store-shards S` the coordinator also hosts S shard servers (each its own libuv thread, so they
run on S cores), and a failure-free step's count and decision go through a two-level tree:

- rank (replica m, position p) counts on shard `(m * P + p) % S` (its *shard*); the rank whose
  add completes its shard's set is that shard's *leader* for the attempt: it counts once on the
  main store, and the leader whose add completes the main count decides there (compare-and-set,
  written once, as with one store);
- every leader then copies the main store's decision into its shard, where its shard's ranks wait
  (a blocking get: one round trip each); a rank whose reduce failed writes `redo` on the main
  store and copies what is there into its own shard.

Invariant: a shard's decision key only ever holds a copy of the main store's decision key (which
is written once), so every rank reads the one decision, whichever store it reads it from. A
shard's ranks that are left waiting (their leader died, or their count can never complete) are
woken by the newer generation that a death publishes, and then decide on evidence through the
main store, as with one store. Work per step: 2 requests per rank on its shard (4 for a leader: 2
more on the main store), so the main server handles 2 S and each shard 2 G / S.

The cross-replica communicators meet on the shards too: every group of position p (its barrier,
its gloo addresses, gloo's own address exchange) on shard `p % S`, a function of the position
alone, so every member of a group picks the same shard (a joiner, and a rank that skipped
generations, too), and knows it before any generation exists. The main store then serves none of
a rebuild's O(R) lookups per member.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from recover.collectives import keys


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


def publish(store: Any, ports: list[int]) -> None:
    """The coordinator says where its shard servers listen (on its own host)."""
    store.set(keys.SHARDS, json.dumps(ports))


def ports(store: Any) -> list[int]:
    """The shard servers' ports; [] when the coordinator hosts none (one store does it all)."""
    raw = keys.try_get(store, keys.SHARDS)
    return [int(p) for p in json.loads(raw)] if raw else []


class ShardTotals:
    """Per generation: how many ranks count on each shard, and how many shards count at all
    (cached: O(R P) once a generation, not once a step)."""

    def __init__(self, positions: int, shards: int) -> None:
        self.positions, self.shards = positions, shards
        self._by_gen: dict[int, dict[int, int]] = {}

    def of(self, g: int, members: list[int]) -> dict[int, int]:
        t = self._by_gen.get(g)
        if t is None:
            if len(self._by_gen) > 8:
                self._by_gen.clear()
            t = self._by_gen[g] = totals(members, self.positions, self.shards)
        return t
