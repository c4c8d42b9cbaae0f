"""Global microbatch ids and their randomness.

Invariant: everything about a microbatch is a pure function of (run seed, global id). Iteration `t`
consumes ids `t*N .. t*N+N-1`, whoever computes them, so regrouping microbatches over a different
set of replicas never changes the data or the random draws of a step.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def step_ids(step: int, n: int) -> list[int]:
    """The N global microbatch ids of iteration `step`."""
    return list(range(step * n, step * n + n))


def id_seed(seed: int, mb_id: int, stream: int = 0) -> int:
    """A 63-bit seed for microbatch `mb_id` (splitmix64 of the run seed, id and stream).

    `stream` separates independent uses (0 = sampling windows, 1 = dropout, 11 = the parameter
    digest's projections, `recover.parallel.digest`) so they never share random numbers.
    """
    z = (seed * 0x9E3779B97F4A7C15 + mb_id * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB)
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


def id_checksum(ids: list[int] | range) -> int:
    """An order-independent checksum of a set of ids: the sum of a 32-bit hash of each id, so
    below 2^52 (exact in float64) for up to 2^20 ids.

    Carried in the reduction trailer so every receiver can verify it holds exactly the step's ids.
    """
    return sum(id_seed(0, i, stream=7) >> 31 for i in ids)
