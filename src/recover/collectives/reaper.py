"""Release of communicators off the thread that drops them.

Invariant: a communicator handed to `retire` (with the works issued on it) is never destroyed by
the caller's thread and never while any of its work is in flight: it stays referenced here until
every future given with it is done *and* nothing else references it (or, past UNOWNED_KEEP_S,
another owner keeps it: then its release is that owner's); one daemon thread then drops the last
reference, so the destructor runs on that thread. `retire` never blocks on a destruction (it
only takes a lock that the reaper holds for list bookkeeping, never across a destructor).

Why: a gloo group's destructor joins its work threads (it waits out an op in flight: up to the
group timeout after a peer's link is cut) and closes one pair per peer (a cost that grows with R
and lands inside the survivors' `agree`: docs/MEASUREMENTS.md, "gloo on CPU"). torch's Python
holder of a process group or work releases the GIL while the C++ destructor runs, so the
trainer's thread keeps running meanwhile.

The thread exists only while something is held (it exits when nothing is left, so a fork server
that checks it is single-threaded is not affected by an idle process). At interpreter exit it
starts no more destructions (a thread inside one when the interpreter finalizes can abort it);
processes that end with os._exit never destroy what is still held.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

REAP_POLL_S = 0.1  # while work is in flight: its end is not urgent
# A failed group is released as soon as its dropper's frame lets go of it (microseconds to
# milliseconds after `retire`): its closing sockets are what makes the other members' pending ops
# fail (docs/MEASUREMENTS.md, "gloo on CPU"), one ring hop at a time, so each hop must not wait for
# a slow poll.
FAST_POLL_S = 0.002
FAST_FOR_S = 1.0
UNOWNED_KEEP_S = 120.0  # an ended group another owner still holds this long: that owner's


def _refs(objs: list[object], i: int) -> int:
    return sys.getrefcount(objs[i])


# What `_refs` counts for an object referenced only by its list (measured here, not assumed).
_SOLE = _refs([object()], 0)


@dataclass
class _Retired:
    objs: list[object]  # the group first, then its works (they share its gloo context)
    futs: list[torch.futures.Future]
    since: float = field(default_factory=time.monotonic)

    def ended(self) -> bool:
        return all(f.done() for f in self.futs)

    def releasable(self, now: float) -> bool:
        if not self.ended():
            return False  # work in flight: destroying the group would wait it out
        return (all(_refs(self.objs, i) <= _SOLE for i in range(len(self.objs)))
                or now - self.since > UNOWNED_KEEP_S)


_RETIRED: list[_Retired] = []
_LOCK = threading.Condition()
_REAPER: list[threading.Thread] = []  # the live reaper thread, if any
_STOPPING = threading.Event()


def retire(pg: object | None, works: Sequence[object] = (),
           futs: Sequence[torch.futures.Future] = ()) -> None:
    """Hand `pg` (and the works issued on it, whose futures are `futs`) to the reaper."""
    if pg is None:
        return
    with _LOCK:
        _RETIRED.append(_Retired([pg, *works], list(futs)))
        _LOCK.notify_all()
        if _REAPER or _STOPPING.is_set():
            return
        th = threading.Thread(target=_loop, name="recover-reaper", daemon=True)
        _REAPER.append(th)
        th.start()


def held() -> int:
    """How many retired communicators are not released yet (for tests and profilers)."""
    with _LOCK:
        return len(_RETIRED)


def _loop() -> None:
    while not _STOPPING.is_set():
        with _LOCK:
            now = time.monotonic()
            free: list[_Retired] = []
            keep: list[_Retired] = []
            for r in _RETIRED:
                (free if r.releasable(now) else keep).append(r)
            _RETIRED[:] = keep
            if not keep and not free:
                _REAPER.clear()  # under the lock: a later `retire` starts a new thread
                return
            fresh = any(r.ended() and now - r.since < FAST_FOR_S for r in keep)
        for r in free:
            if _STOPPING.is_set():
                return  # left unreleased: the interpreter is exiting
            r.objs.clear()  # the last references: the destructors run in this thread
        if free:
            continue  # more may have been retired while destroying
        with _LOCK:
            _LOCK.wait(FAST_POLL_S if fresh else REAP_POLL_S)


def _stop() -> None:
    _STOPPING.set()
    with _LOCK:
        _LOCK.notify_all()
        live = list(_REAPER)
    for th in live:
        th.join(5.0)  # bounded: a destruction still running is left to the exit


atexit.register(_stop)
