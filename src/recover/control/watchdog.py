"""A rank's main-thread progress watchdog: a deadlock told apart from a slow step by progress,
since its heartbeats (another thread's) go on.

Invariant: while armed, a main thread that reports no `progress()` for `stuck_s` is overdue
(`overdue`: the `Member`'s watchdog thread then fences the process, ExitCode.STUCK), and past
`report_after_s` it is stalled (`stalled_s`, said in its heartbeats: evidence against it when
others name it or wait for it, `Membership`). Disarmed, or inside `paused`, neither holds. The
span between two steps (`arm_between` -> the next `arm`) is kept as `between_s`, the measure a
waiter sends with `wait` (`Membership.waiting`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# Stalled this fraction of its stuck bound, a main thread says so in its heartbeats: evidence for an
# eviction when others name it, before it fences itself (lateness alone never evicts anyone).
STALL_REPORT_FRACTION = 0.5


class ProgressWatch:
    def __init__(self) -> None:
        self._stuck_s = 0.0  # 0: disarmed
        self._report_after_s = 0.0
        self._progress = time.monotonic()
        self.between_s = 0.0  # the last span between two steps
        self._between_since: float | None = None  # when the open one began

    def arm(self, stuck_s: float, report_after_s: float | None = None) -> None:
        """From now on, `stuck_s` without `progress()` means this main thread is stuck, and
        `report_after_s` (default: STALL_REPORT_FRACTION of it) that it is stalled. Armed inside
        a step after `arm_between`, it also ends the span between steps."""
        if self._between_since is not None:
            self.between_s = time.monotonic() - self._between_since
            self._between_since = None
        self._arm(stuck_s, report_after_s)

    def arm_between(self, stuck_s: float, report_after_s: float) -> None:
        """`arm` for the time between two steps (the optimizer, the caller's own code): the
        span until the next `arm` is this rank's measure of that work (`between_s`)."""
        self._arm(stuck_s, report_after_s)
        self._between_since = self._progress

    def _arm(self, stuck_s: float, report_after_s: float | None) -> None:
        self._progress = time.monotonic()
        self._stuck_s = stuck_s
        self._report_after_s = report_after_s if report_after_s is not None \
            else STALL_REPORT_FRACTION * stuck_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A long operation bounded on its own (a checkpoint save, serving a joiner's state):
        the watchdog stops meanwhile, then resumes with the same bounds."""
        stuck_s, report_after_s = self._stuck_s, self._report_after_s
        self.disarm()
        try:
            yield
        finally:
            if stuck_s:
                self._arm(stuck_s, report_after_s)

    def progress(self) -> None:
        self._progress = time.monotonic()

    def disarm(self) -> None:
        self._stuck_s = 0.0

    def stalled_s(self) -> float:
        """Seconds the armed main thread has gone without progress, once that exceeds its
        report bound (`arm`; 0.0 otherwise, and while disarmed)."""
        stuck_s, report_after_s = self._stuck_s, self._report_after_s
        age = time.monotonic() - self._progress
        return age if stuck_s and age > report_after_s else 0.0

    def overdue(self, now: float) -> tuple[float, float] | None:
        """(seconds without progress, the bound) once the armed bound is passed; else None."""
        stuck_s, age = self._stuck_s, now - self._progress
        return (age, stuck_s) if stuck_s and age > stuck_s else None
