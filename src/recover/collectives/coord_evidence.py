"""The coordinator's evidence: failed reduces and members missing at barriers, weighed.

Invariant (with those of `recover.collectives.coordinator`, whose state this mixin shares): a
member is evicted on others' naming only when `admission.convicted` convicts it (its main thread
stalled, or it reaches nobody); a naming that its reporter withdraws (`arrived`) stands no more;
naming that neither convicts nor is withdrawn rebuilds the same members after 2 x stale_s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from recover.collectives.admission import convicted


class Evidence:
    """Mixin of `Coordinator`: whom failed reduces convict (see the module docstring)."""

    # Declared for type checkers; `Coordinator` sets or defines them.
    accusations: dict[int, set[int]]
    accused_since: float | None
    members: list[int]
    _conns: dict[int, Any]
    _mark_lost: Callable[[int | None, str], None]

    def _evidence(self, reporter: int, suspects: list[int]) -> None:
        """A failed reduce, or members missing at a barrier: rebuild, or evict whom the evidence
        convicts (`admission.convicted`: a stalled member others name; a partitioned member that
        names everyone while everyone names it)."""
        for s_ in suspects:
            if s_ != reporter and s_ in self.members:
                self.accusations.setdefault(s_, set()).add(reporter)
        if self._judge():
            return
        if suspects:
            # Not conclusive (late members may be slow, not lost): a member that stalls is
            # convicted as its heartbeat says so (`_judge`), one that arrives is withdrawn
            # (`arrived`); after 2 x stale_s with neither, rebuild anyway.
            self.accused_since = self.accused_since or time.monotonic()
        else:
            self._mark_lost(None, f"reduce failed at replica {reporter}")

    def _judge(self) -> bool:
        """Evict every member the standing evidence convicts; True if any."""
        stalled = {c.replica for c in self._conns.values()
                   if c.stalled and c.replica in self.members}
        guilty = convicted(self.accusations, self.members, stalled)
        for r in guilty:
            how = "its main thread stalled" if r in stalled else "it reaches nobody"
            self._mark_lost(r, f"unreachable, named by replica(s) "
                               f"{sorted(self.accusations[r])} ({how})")
        return bool(guilty)

    def _withdraw(self, reporter: int) -> None:
        """The members `reporter` named have arrived at its barrier: its accusations stand no
        more (nothing is rebuilt for a member that was only late)."""
        for accused in list(self.accusations):
            self.accusations[accused].discard(reporter)
            if not self.accusations[accused]:
                del self.accusations[accused]
        if not self.accusations:
            self.accused_since = None
