"""The integer-gradient oracle: what a rank's reduced gradient must be, exactly, after a step.

Invariant: microbatch id i adds `weight(i)` times the rank's `pattern` to its gradient (a scalar
pattern of 1 where the gradient is filled uniformly), and both are small integers, so every
partial sum and every total is an integer: exact whatever the summation order, the grouping or
which replica computed which id, as long as it stays below the dtype's integer range (2**24 in
float32, 2**53 in float64, 256 in bf16; a step of N ids at step t sums to about N * (t N + N/2)
times the pattern's largest value, `PATTERN_MAX` for position 0). A committed step's gradient is
therefore exactly `expected(step, n) * pattern`: an id dropped, counted twice, or taken from
another step (their weights differ) shows as a difference. Weights grow with the id (i + 1), not
modulo N, for that last reason. Each id's loss is `loss(i)`, so a step's mean loss is exact too.
"""

from __future__ import annotations

import torch

from recover.workload import step_ids

PERIOD = 5  # the pattern repeats every PERIOD elements
PATTERN_MAX = PERIOD  # the largest value of position 0's pattern


def weight(i: int) -> int:
    """Microbatch id i's weight: i + 1 (never 0, different for every id)."""
    return i + 1


def pattern(numel: int, position: int = 0, dtype: torch.dtype = torch.float32,
            device: torch.device | str | None = None) -> torch.Tensor:
    """The small integers each id's gradient is made of at `position` (a rank's place in its
    replica): 1..PERIOD at position 0, PERIOD+1..2 PERIOD at position 1, and so on, so that
    ranks at different positions never hold the same values."""
    base = torch.arange(numel, device=device) % PERIOD + 1 + PERIOD * position
    return base.to(dtype)


def add(grad: torch.Tensor, i: int, base: torch.Tensor | None = None) -> None:
    """Add microbatch i's gradient in place: weight(i) * base, or weight(i) everywhere."""
    if base is None:
        grad.add_(weight(i))
    else:
        grad.add_(base, alpha=weight(i))


def step_weight(step: int, n: int) -> int:
    """The sum of the weights of step `step`'s n ids: what each pattern element is multiplied by."""
    return sum(weight(i) for i in step_ids(step, n))


def expected(step: int, n: int, base: torch.Tensor | None = None) -> torch.Tensor | float:
    """The reduced gradient of `step`: step_weight * base (computed in float64, exactly; cast it
    to the gradient's dtype to compare), or that number where the gradient is uniform."""
    if base is None:
        return float(step_weight(step, n))
    return base.double() * step_weight(step, n)


def loss(i: int) -> float:
    """Microbatch id i's loss: small integers, so any mean of them is reproducible."""
    return float(i % 7)


def expected_loss(step: int, n: int) -> float:
    """The step's mean loss over its n ids, as the engine reports it."""
    return sum(loss(i) for i in step_ids(step, n)) / n
