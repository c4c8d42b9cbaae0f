"""Store clients that count the requests they send, per server: the main store or a shard.

Invariants:
- A `CountedStore` forwards every call to its real client unchanged, and counts each call that
  makes requests of the server once (a `get` that the server answers after waiting is one call,
  as the engine's round trips are counted), under its server's label, with the keys it names.
  Its clones count into the same `Tally`, so wrapping the one client a process connects first
  counts every client it opens from it (background threads' clones included).
- A member counts its protocol's requests this way (`Member.store`; the heartbeat carries the
  total to the coordinator); the communicator's rendezvous and gloo get the plain client
  (`Member.plain_store`): gloo holds its store through a C++ pointer, and a Python store
  object collected under it leaves that pointer without methods ("Not implemented").
- `counting_connect` (tests, benches: every client a process opens, gloo's included) makes its
  tally keep every wrapper alive for that reason.
- Client-side: the server's own work per call (a wait, then a read, for a blocking `get`) is not
  split out; every count here is a call a client made.
- A tally made with `stats` also adds 1 to `stats[stat]` per call, as it counts it: the step
  engine's `stats["store_ops"]` (recovery/step.py) is its critical-path clients' tally.
"""

from __future__ import annotations

import datetime
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

_KIND = re.compile(r"\d+")


class Tally:
    """Calls per server label, and (when `keep_keys`) the keys each server was asked about."""

    def __init__(self, keep_keys: bool = False, keep_alive: bool = False,
                 stats: dict[str, float] | None = None, stat: str = "store_ops") -> None:
        self.calls: Counter[str] = Counter()
        # Calls per (server label, key kind: the first key named, its numbers as '#'), for
        # breakdowns (bench/scale.py): which protocol keys a failure's requests touch.
        self.kinds: Counter[tuple[str, str]] = Counter()
        self.keys: dict[str, set[str]] = {}
        # Bytes of the values the server sent back (get, multi_get, compare_set), per label:
        # gloo's address exchange reads O(R) values of O(R) bytes each (meshstore.py).
        self.served: Counter[str] = Counter()
        self.keep_keys, self.keep_alive = keep_keys, keep_alive
        self.stats, self.stat = stats, stat
        self._lock = threading.Lock()
        self._alive: list[CountedStore] = []

    def note(self, where: str, names: Iterable[str]) -> None:
        with self._lock:
            self.calls[where] += 1
            if self.stats is not None:
                self.stats[self.stat] += 1
            names = list(names)
            self.kinds[where, _KIND.sub("#", names[0]) if names else "-"] += 1
            if self.keep_keys:
                self.keys.setdefault(where, set()).update(names)

    def got(self, where: str, nbytes: int) -> None:
        with self._lock:
            self.served[where] += nbytes

    def keep(self, store: CountedStore) -> None:
        if self.keep_alive:
            with self._lock:
                self._alive.append(store)

    def total(self, where: str) -> int:
        with self._lock:
            return self.calls[where]

    def bytes_served(self, where: str) -> int:
        with self._lock:
            return self.served[where]

    def by_kind(self, where: str) -> dict[str, int]:
        """{key kind: calls} on the server `where` so far."""
        with self._lock:
            return {k: n for (w, k), n in self.kinds.items() if w == where}


class CountedStore(dist.Store):
    """A counting wrapper of one store client (see the module's invariants)."""

    def __init__(self, inner: Any, tally: Tally, where: str) -> None:
        super().__init__()
        self._inner, self._tally, self._where = inner, tally, where
        tally.keep(self)

    def _count(self, *names: str) -> None:
        self._tally.note(self._where, names)

    def set(self, key: str, value: Any) -> None:
        self._count(key)
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count(key)
        value = self._inner.get(key)
        self._tally.got(self._where, len(value))
        return value

    def add(self, key: str, value: int) -> int:
        self._count(key)
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._count(key)
        value = self._inner.compare_set(key, expected, desired)
        self._tally.got(self._where, len(value))
        return value

    def check(self, keys: list[str]) -> bool:
        self._count(*keys)
        return self._inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count(*keys)
        values = self._inner.multi_get(keys)
        self._tally.got(self._where, sum(len(v) for v in values))
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._count(*keys)
        self._inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self._count(key)
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        self._count()
        return self._inner.num_keys()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._count(*keys)
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def set_timeout(self, timeout: datetime.timedelta) -> None:  # the client's own: no request
        self._inner.set_timeout(timeout)

    def clone(self) -> CountedStore:
        return CountedStore(self._inner.clone(), self._tally, self._where)


def counting_connect(connect: Callable[[str, int, float], Any], tally: Tally,
                     main_port: int | None) -> Callable[[str, int, float], Any]:
    """`connect(host, port, timeout_s)` whose clients count: "main" for `main_port` (every
    client when None), else "shard:<port>" (for `keys.connect_store`, in a test or a process
    that counts every client it opens)."""

    tally.keep_alive = True  # gloo may hold these clients (see the module's invariants)

    def wrapped(host: str, port: int, timeout_s: float) -> CountedStore:
        where = "main" if main_port in (None, port) else f"shard:{port}"
        return CountedStore(connect(host, port, timeout_s), tally, where)

    return wrapped
