"""A scheduler's preemption as a process sees it: SIGTERM, then SIGKILL after a grace period.

Invariant: the first SIGTERM only asks (an Event, read at a point where stopping loses nothing:
a replica's step boundary, the launcher's supervision loop); the second SIGTERM takes the path a
SIGTERM takes without this handler (`fallback`: a replica ends at once, as killed; the launcher
is interrupted). A replica also arms SIGALRM for the grace period: not gone by then, it
ends as a crash (SIGALRM's default action) before the scheduler's SIGKILL would. The handler
itself only sets flags and signals: no logging, no locks (it runs between any two bytecodes).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType


def die_by_sigterm() -> None:
    """A replica's fallback: the default action of SIGTERM (the process ends, as killed)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


class Preemption:
    """SIGTERM handling for one process: `requested` is set by the first signal."""

    def __init__(self, fallback: Callable[[], None], grace_s: float | None = None) -> None:
        self.requested = threading.Event()
        self.fallback, self.grace_s = fallback, grace_s

    def install(self) -> Preemption:
        signal.signal(signal.SIGTERM, self.handle)
        return self

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():  # a second SIGTERM: no more waiting for a boundary
            self.fallback()
            return
        self.requested.set()
        if self.grace_s is not None:  # whole seconds: alarm(0) would cancel rather than arm
            signal.alarm(max(1, int(self.grace_s)))
