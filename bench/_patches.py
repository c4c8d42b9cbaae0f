"""Proposed library changes, tried by monkeypatching worker processes (`overhead.py --patched`).

Nothing here edits src/; each function is written to be pasted into the named module. They cut
the store round-trips of a failure-free step (measured ~26-40 per replica-step, see
`bench/overhead.py`) to about 8, without changing any decision the protocol makes:

1. `recover.collectives.keys.try_get`: one round-trip instead of two (`check` + `get`):
   `compare_set(key, ABSENT, ABSENT)` returns the value if the key exists and never creates a
   missing key when `expected != ""` (DESIGN §5; verified on torch 2.13).
2. `StepEngine._decide`: instead of polling every 0.5 ms with 1 + 2R round-trips per poll,
   block in the server (`store.wait` on the live members' outcome keys, in 100 ms slices that
   re-check the membership), then read them with one `multi_get`. Same rule: commit iff every
   live member of g reported ok; redo if any live member failed.
3. `StepEngine._speeds`: one `check` + one `multi_get` instead of 2R round-trips.
4. `FaultTolerantComm.reduce`: the training thread wakes every `poll_s` = 2 ms while gloo
   reduces (~85 wake-ups for a 170 ms allreduce) only to compare generations. Tried here as a
   20 ms poll during the allreduce (the group is built first with the fine poll); the proper fix
   is event-driven: Member sets a registered `threading.Event` when it learns a generation, and
   reduce waits on one Event that either the future's callback or a new generation sets.
5. `Coordinator._check_heartbeats` runs every loop turn (10 ms) and reads each heartbeat counter
   with its own round-trip: ~R x 100 round-trips/s served and made by the coordinator. Checking
   every 100 ms is plenty for a 1 s staleness threshold (a crash is seen sooner, by its closed
   liveness socket). Run as `python bench/_patches.py coordinator ARGS` for the patched one.
"""

from __future__ import annotations

import datetime
import sys
import time

from torch.distributed import DistStoreError

ABSENT = "\x00recover:absent"


def try_get(store, key: str) -> bytes | None:
    """Non-blocking get in one round-trip: None when the key does not exist yet."""
    v = store.compare_set(key, ABSENT, ABSENT)
    return None if v == ABSENT.encode() else v


def _decide(self, step: int, g: int) -> bytes:
    """Commit iff every position of every surviving member of g holds a verified result;
    decided once. Waits in the store server, not by polling."""
    from recover.recovery.step import RecoveryError

    dkey = self._key(step, g, "decision")
    ranks = [(m, p) for m in self.member.members(g) for p in range(self.positions)]
    okey = {r: self._key(step, g, self._out(*r)) for r in ranks}
    deadline = time.monotonic() + self.timeout_s
    while True:
        live = set(self.member.members(self.member.generation()))
        need = [okey[r] for r in ranks if r[0] in live]
        try:
            self.store.wait(need, datetime.timedelta(milliseconds=100))
        except DistStoreError:  # not all there yet: someone may have decided; a member may be gone
            decided = try_get(self.store, dkey)
            if decided is not None:
                return decided
            self.member.check()
            if time.monotonic() > deadline:
                raise RecoveryError(f"no commit decision for step {step} within "
                                    f"{self.timeout_s}s") from None
            continue
        outs = self.store.multi_get(need)
        proposal = b"redo" if any(v == b"fail" for v in outs) else b"commit"
        # A member that died after the reduce completed everywhere does not block the commit:
        # a verified trailer proves its part is inside the sum (its key is not in `need`).
        return self.store.compare_set(dkey, "", proposal)


def _speeds(self, members: list[int]) -> dict[int, float]:
    keys = [f"speed/{m}" for m in members]
    if self.store.check(keys):
        return {m: float(v) for m, v in zip(members, self.store.multi_get(keys), strict=True)}
    out = {}
    for m in members:
        raw = try_get(self.store, f"speed/{m}")
        if raw is not None:
            out[m] = float(raw)
    return out


def _coarse_poll(orig):
    def reduce(self, tensor, generation=None, on_issued=None):
        self.prepare(generation)  # barrier + build (if needed) with the fine poll
        fine, self.poll_s = self.poll_s, 0.02
        try:
            return orig(self, tensor, generation, on_issued)
        finally:
            self.poll_s = fine
    return reduce


def apply() -> None:
    import recover.collectives.comm as comm
    import recover.collectives.keys as keys
    import recover.recovery.step as step

    comm.FaultTolerantComm.reduce = _coarse_poll(comm.FaultTolerantComm.reduce)

    keys.try_get = try_get
    step.try_get = try_get  # imported by name there
    step.StepEngine._decide = _decide
    step.StepEngine._speeds = _speeds


def _rate_limited(orig, every_s: float = 0.1):
    def check(self, now: float) -> None:
        if now - getattr(self, "_hb_checked", 0.0) >= every_s:
            self._hb_checked = now
            orig(self, now)
    return check


if __name__ == "__main__" and sys.argv[1:2] == ["coordinator"]:
    from recover.collectives import coordinator

    coordinator.Coordinator._check_heartbeats = _rate_limited(
        coordinator.Coordinator._check_heartbeats)
    sys.exit(coordinator.main(sys.argv[2:]))
