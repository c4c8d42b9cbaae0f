"""Deadlines and bounded polls: how recover waits for a condition it cannot block on.

Invariants:
- A `Deadline` is a fixed point on the monotonic clock (never the wall clock, which may jump);
  `left()` is never negative, and `sleep` never sleeps past the deadline.
- Nothing here blocks without a bound: `poll_until` and `wait_until` return (or raise) once the
  deadline has passed, after at most one more poll interval and one more call of the predicate.
  The predicate is always asked at least once, and once more after the last sleep, so a
  condition that came true by the deadline is seen.
- This module depends on nothing but the standard library: every layer of recover may use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Deadline:
    """`timeout_s` seconds from when it is made (or from a given monotonic time, `at`)."""

    __slots__ = ("at", "timeout_s")

    def __init__(self, timeout_s: float, at: float | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.at = (time.monotonic() if at is None else at) + self.timeout_s

    def left(self) -> float:
        """Seconds until the deadline (0 once it passed)."""
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() > self.at

    def sleep(self, poll_s: float) -> None:
        """Sleep `poll_s`, or until the deadline if that comes first."""
        time.sleep(min(poll_s, self.left()))

    def sooner(self, other: Deadline) -> Deadline:
        """The earlier of this deadline and `other`."""
        return other if other.at < self.at else self


def poll_until(predicate: Callable[[], T], within: float | Deadline, poll_s: float) -> T:
    """`predicate()`'s first truthy value, asked every `poll_s` (see the module's invariants);
    its last value (falsy) once `within` (seconds, or a `Deadline`) has passed."""
    deadline = within if isinstance(within, Deadline) else Deadline(within)
    while True:
        value = predicate()
        if value or deadline.passed():
            return value
        deadline.sleep(poll_s)


def wait_until(predicate: Callable[[], T], within: float | Deadline, poll_s: float,
               what: str) -> T:
    """`poll_until`, but a TimeoutError (message `what`: what did not happen in time) where it
    would return a falsy value. The predicate may raise to end the wait another way."""
    value = poll_until(predicate, within, poll_s)
    if not value:
        raise TimeoutError(what)
    return value
