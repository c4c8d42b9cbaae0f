"""A planned leave: a replica leaves the run at a step boundary once asked (a scheduler's SIGTERM,
or an event of the caller's, `Replica.leave_when`), and the others take its share.

Invariant: every rank of a replica sees `leaving` turn True after the same step, whichever of
them was asked: a one-rank replica asks itself; the ranks of a multi-rank replica use what they
agreed in the step's closing intra-replica sum (`agreed`). Why agreed: ranks are signalled at
different moments, and one that went on into the next step alone would lose the whole replica as
a crash. The replica's own SIGTERM handler is installed only where the process has none (and only
from the main thread: `signal` allows no other); it only sets a flag (it runs between bytecodes),
and a second SIGTERM takes the default action (the process ends, as killed).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["PlannedLeave"]


class PlannedLeave:
    """Whether this rank was asked to leave (`asked`), and whether its replica leaves
    (`leaving`). `exits`: the replica's own SIGTERM handler asked, so its next `step` leaves and
    ends the process with exit code 0."""

    def __init__(self, nranks: int) -> None:
        self.nranks = nranks
        self.event: threading.Event | None = None  # set: this rank was asked
        self.agreed = False  # the ranks' agreement after the last step (a multi-rank replica)
        self.exits = False  # our own SIGTERM handler asked: `step` ends the process
        self.handler: Callable[[int, Any], None] | None = None  # that handler, once installed

    def install_sigterm(self, enabled: bool) -> None:
        """SIGTERM as a planned leave at the next step boundary, where `enabled`, no event was
        given (`when`) and the process has no handler of its own, from the main thread."""
        if (not enabled or self.event is not None
                or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)):
            return
        asked = threading.Event()

        def handle(signum: int, frame: Any) -> None:  # flags only: it runs between bytecodes
            if asked.is_set():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            asked.set()

        signal.signal(signal.SIGTERM, handle)
        self.event, self.exits = asked, True
        self.handler = handle

    def when(self, asked: threading.Event) -> None:
        """Leave once `asked` is set (`Replica.leave_when`); replaces the replica's own SIGTERM
        handler, if it installed one."""
        if self.exits and signal.getsignal(signal.SIGTERM) is self.handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.event, self.exits = asked, False

    def asked(self) -> bool:
        """Whether this rank was asked to leave."""
        return self.event is not None and self.event.is_set()

    @property
    def leaving(self) -> bool:
        """Whether to leave at this step boundary: one rank asks itself; the ranks of a
        multi-rank replica use what they agreed after the last step, all alike."""
        return self.asked() if self.nranks == 1 else self.agreed
