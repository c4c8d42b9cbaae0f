"""Global microbatch ids and their randomness.

Invariants:
- Everything about a microbatch is a pure function of (run seed, global id). Iteration `t`
  consumes ids `t*N .. t*N+N-1`, whoever computes them, so regrouping microbatches over a
  different set of replicas never changes the data or the random draws of a step.
- `Stream` is the one registry of `id_seed`'s streams: every use of per-id randomness in recover
  takes its number from it, and no two uses share one (so they never share random numbers).
  A number, once given, is never reused for another use: runs' data and draws depend on it.
- `mix64` is the one writing of splitmix64's finaliser (the hash under `id_seed` and the data
  order's permutation, `recover.data.order`).
"""

from __future__ import annotations

from enum import IntEnum, unique
from typing import TypeVar

_MASK64 = (1 << 64) - 1
_T = TypeVar("_T")


@unique
class Stream(IntEnum):
    """`id_seed`'s streams, one per use of per-id randomness (the module's invariant)."""

    SAMPLE = 0  # `recover.data.IdBatches`' random draws (fixed: a new one changes every run's)
    DROPOUT = 1  # a microbatch's own randomness: the app's dropout, an own loop's `id_rng`
    EVAL = 2  # the app's validation windows, apart from training's
    ORDER = 3  # the keys of the epoch order's permutations (`recover.data.order`)
    CHECKSUM = 7  # `id_checksum`'s per-id hash
    DIGEST = 11  # the parameter digest's projection vectors (`recover.replica.digest`)


def mix64(z: _T) -> _T:
    """splitmix64's finaliser of 64-bit values: a Python int, or a numpy uint64 array (masked
    modulo 2^64 either way, so both give the same bits)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64  # type: ignore[operator]
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64  # type: ignore[operator]
    return z ^ (z >> 31)  # type: ignore[operator]


def step_ids(step: int, n: int) -> list[int]:
    """The N global microbatch ids of iteration `step`."""
    return list(range(step * n, step * n + n))


def id_seed(seed: int, mb_id: int, stream: int = Stream.SAMPLE) -> int:
    """A 63-bit seed for microbatch `mb_id` (splitmix64 of the run seed, id and stream).

    `stream` (a `Stream`) separates independent uses so they never share random numbers.
    """
    z = (seed * 0x9E3779B97F4A7C15 + mb_id * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB)
    return mix64(z & _MASK64) & ((1 << 63) - 1)


def id_checksum(ids: list[int] | range) -> int:
    """An order-independent checksum of a set of ids: the sum of a 32-bit hash of each id, so
    below 2^52 (exact in float64) for up to 2^20 ids.

    Carried in the reduction trailer so every receiver can verify it holds exactly the step's ids.
    """
    return sum(id_seed(0, i, stream=Stream.CHECKSUM) >> 31 for i in ids)
