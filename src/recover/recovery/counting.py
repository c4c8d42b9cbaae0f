"""A store client that counts its round trips, for the step engine's profilers.

Invariant: every request the step protocol makes on the critical path of a step (the chain, the
count, the decision, the evidence) goes through a `CountingStore` sharing one `stats` dict, so
`stats["store_ops"]` is exactly those round trips. Blocking key waits run on a waiter's own client
(counted by the waiter), and the key deletions run off the critical path on the key lifetime's
own client (`stats["store_deletes"]`, recovery/lifetime.py).
"""

from __future__ import annotations

from typing import Any


class CountingStore:
    """Wraps a store client; each call of one of its methods adds 1 to `stats["store_ops"]`."""

    def __init__(self, store: Any, stats: dict[str, float]) -> None:
        self._store, self._stats = store, stats

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._stats["store_ops"] += 1
            return attr(*args, **kwargs)

        return call
