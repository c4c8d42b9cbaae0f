"""Supervising a launch's processes to the run's end, winding them down, saying how each ended.

Invariant: the launcher only reads the step records; it never kills a survivor because another
replica died. Every wait is bounded (a stall, the survivors' leaving, the coordinator's settling).
The coordinator outlives the replicas: a replica still finishing its last step needs the store.
What the store says (a stop reason any client can write) is shown as bounded, printable text.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path
from typing import Any

from recover.app import rundir
from recover.app.runtoken import resume_token
from recover.app.train.metrics import MetricsSink
from recover.control import keys, try_get
from recover.control.member import PREEMPTED
from recover.control.membership import clean_leave
from recover.deadline import Deadline
from recover.errors import ExitCode
from recover.procs import Process

MAX_REASON = 500  # bytes of a stop reason read from the store that the launcher shows
# After the last replica process exits, how long the launcher waits for the coordinator to have
# taken every replica off the membership (ms on a quiet machine) before it reads the exit records.
SETTLE_S = 2.0


def exit_meaning(code: int) -> str | None:
    """A process's exit code in words: its `ExitCode`, or the signal that ended it."""
    with contextlib.suppress(ValueError):
        return ExitCode(code).meaning
    with contextlib.suppress(ValueError):
        if code < 0:
            return f"killed ({signal.Signals(-code).name})"
    return None


def said(raw: bytes) -> str:
    """A reason read from the store (`run/stopped`: any client can write it), as printable text
    of bounded length: never a decoding error at the run's end."""
    text = " ".join(raw[:MAX_REASON].decode(errors="replace").split())
    return text + ("..." if len(raw) > MAX_REASON else "")


def checkpoint_note(out: Path) -> str:
    """Where `--resume` would continue a preempted run from, in words."""
    from recover.app.train.checkpoint.files import find_latest

    with contextlib.suppress(Exception):  # no token, no folder: said below
        ckpt, _ = find_latest(out / rundir.CKPT, resume_token(out))
        if ckpt is not None:
            return f"checkpoint {ckpt.name}; continue with --resume"
    return f"no checkpoint in {out / 'ckpt'}"


def meaning_or_code(code: int | None) -> str | int | None:
    return code if code is None else (exit_meaning(code) or code)


def _all_gone(store: Any, workers: dict[int, Process], external: bool) -> bool:
    """Every replica has exited (local children) or left the membership (external ones)."""
    if not external:
        return all(p.poll() is not None for p in workers.values())
    try:
        return keys.newest_members(store) == []
    except (ValueError, TypeError):  # not a member list (a stranger's value): not known empty
        return False


def await_leaving(store: Any, coord: Process, procs: dict[tuple[int, int], Process],
                  external: bool, limit_s: float) -> None:
    """Wait (bounded) until every replica has left: local processes exit; external ones leave
    the membership. The coordinator must outlive them: a replica still finishing its last step
    (the leader's final checkpoint) needs the store, and would otherwise end as if it failed."""
    deadline = Deadline(limit_s)
    while not deadline.passed():
        if not external:
            if all(p.poll() is not None for p in procs.values()):
                # Their last words (a bye, a closed liveness socket) reach the coordinator just
                # after they exit: let it take them all off the membership first, or the exit
                # records read its view from before (a preempted replica read as "running").
                _await_no_members(store, coord, deadline.sooner(Deadline(SETTLE_S)))
                return
        elif coord.poll() is not None:
            return
        else:
            try:
                if keys.store_int(store, keys.GEN_COUNT) == 0 or _all_gone(store, {}, True):
                    return  # nobody joined, or every member left or was dropped
            except Exception:  # the store went away with the coordinator
                return
        time.sleep(0.05)


def _await_no_members(store: Any, coord: Process, until: Deadline) -> None:
    """Wait until the coordinator's newest generation is empty (or it is gone), until `until`."""
    while not until.passed() and coord.poll() is None:
        try:
            if keys.newest_members(store) == []:
                return
        except Exception:  # the store went away with the coordinator
            return
        time.sleep(0.02)


def describe_exits(replicas: int, codes: dict[int, int | None],
                   seen: dict[int, str]) -> dict[int, str]:
    """One phrase per replica: its exit code (if started here) and the coordinator's view."""
    out: dict[int, str] = {}
    for r in range(replicas):
        parts = []
        if r in codes:
            c = codes[r]
            # A preempted replica exits 0 too (a planned leave): not "finished".
            left = PREEMPTED if c == 0 and seen.get(r) == clean_leave(PREEMPTED) else None
            parts.append("still running (ended by the launcher)" if c is None else
                         f"exit {c} ({left or exit_meaning(c) or 'error'})")
        if r in seen:
            parts.append(f"coordinator: {seen[r]}")
        out[r] = ", ".join(parts) or "never joined"
    return out


def supervise(store: Any, sink: MetricsSink, end: int, procs: dict[tuple[int, int], Process],
              external: bool, stall_limit: float, restarts: dict[int, int] | None = None,
              restart: Any = None, preempt: threading.Event | None = None) -> str:
    """Write records as they arrive until the last step, or until the run cannot go on; start a
    replica again once step S-1 committed for a `restart:replica=R,step=S` fault (if it died).
    A fault is removed from `restarts` once done: supervising again after a coordinator restart
    must not restart a replica that has since finished (the last line waits for the final save)."""
    last_progress = time.monotonic()
    restarts = {} if restarts is None else restarts
    while sink.next < end and not (preempt is not None and preempt.is_set()):
        for r, at in list(restarts.items()):
            # Started again as soon as it is gone (a replacement takes seconds to start); it is
            # admitted at the first step boundary >= `at` after it registered.
            ranks = [p for (rr, _), p in procs.items() if rr == r]
            if all(p.poll() is not None for p in ranks):
                del restarts[r]
                restart(r, at)
                last_progress = time.monotonic()
        workers = dict(enumerate(procs.values()))
        if sink.poll():
            last_progress = time.monotonic()
            continue
        if _all_gone(store, workers, external):
            # Nobody can offer a record any more: the last save point's line is taken even
            # from a replica that did not write (its writer was killed after the commit).
            sink.poll(final=True)
            return ""
        stopped = try_get(store, keys.RUN_STOPPED)
        if stopped is not None and all(p.poll() is not None for p in workers.values()):
            return said(stopped)
        if time.monotonic() - last_progress > stall_limit:
            return f"no step committed for {stall_limit:.0f}s"
        time.sleep(0.02)
    return ""
