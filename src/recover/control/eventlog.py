"""The coordinator's event log: one JSON line per event, and the notable ones in its process log.

Invariant: the event log never stops the coordinator nor fills its disk on a stranger's behalf.
An append that fails (a full disk) is reported once per episode and the events meanwhile are
counted, not kept; the events a peer causes by what it sends (junk, a refused hello) are kept at
most NOISY_BURST per NOISY_WINDOW_S per (kind, peer address), the rest counted in one
`suppressed` event per window.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger(__name__)

# Events worth a line in the process's log (every event goes to the JSON event log, --log).
_NOTABLE = {"start", "generation", "refused", "join", "join-failed", "resumed", "resume-failed",
            "join-timeout", "all-left", "malformed", "stranger-dropped", "suppressed"}
# Events a peer causes by what it sends (junk, a refused hello): kept at most NOISY_BURST per
# NOISY_WINDOW_S per (kind, peer address) (`EventLog`).
_NOISY = {"malformed", "stranger-dropped", "refused"}
NOISY_BURST = 20
NOISY_WINDOW_S = 10.0


class EventLog:
    """One JSON line per event appended to `path` (none: not kept), and the notable ones logged.

    Neither can stop the coordinator nor fill its disk on a stranger's behalf: an append that
    fails (a full disk) is reported once per episode and the events meanwhile are counted, not
    kept; the events a peer causes by sending junk (`_NOISY`) are kept at most NOISY_BURST per
    NOISY_WINDOW_S per (kind, peer), the rest counted in one `suppressed` event per window."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._failing: str | None = None  # why appends fail, while they do
        self._lost = 0  # events not kept while they failed
        self._noise: dict[tuple[str, str], list[float]] = {}  # (kind, peer) -> [since, kept, cut]

    def __call__(self, rec: dict) -> None:
        if rec.get("event") in _NOISY and not self._admit(rec):
            return
        rec = {"time": round(time.time(), 4), **rec}
        line = json.dumps(rec)
        if self.path:
            self._append(line)
        log.log(logging.INFO if rec.get("event") in _NOTABLE else logging.DEBUG, "%s", line)

    def _append(self, line: str) -> None:
        try:
            with open(self.path, "a") as f:  # type: ignore[arg-type]
                f.write(line + "\n")
        except OSError as e:
            if self._failing is None:
                log.warning("cannot append to the event log %s (%s): events are not kept until "
                            "it works again; the coordinator goes on", self.path, e.strerror or e)
            self._failing, self._lost = str(e), self._lost + 1
            return
        if self._failing is not None:
            log.warning("the event log %s takes appends again; %d event(s) were not kept",
                        self.path, self._lost)
            self._failing, self._lost = None, 0

    def _admit(self, rec: dict) -> bool:
        """Whether a noisy event is kept (see the class docstring)."""
        now = time.monotonic()
        key = (str(rec.get("event")), str(rec.get("peer", rec.get("replica"))))
        entry = self._noise.get(key)
        if entry is None or now - entry[0] > NOISY_WINDOW_S:
            cut = int(entry[2]) if entry else 0
            if len(self._noise) > 4096:  # many peers: forget the oldest windows' counts
                self._noise.clear()
            self._noise[key] = entry = [now, 0, 0]
            if cut:  # not noisy itself: no recursion
                self({"event": "suppressed", "kind": key[0], "peer": key[1], "count": cut})
        if entry[1] < NOISY_BURST:
            entry[1] += 1
            return True
        entry[2] += 1
        return False
