"""Start and stop child processes by PID: SIGCONT, SIGTERM, a grace period, SIGKILL.

Invariant: a process is only ever signalled by its own PID, never by name or process group, and
only while it is known to exist: a `Popen` child is signalled only until it has been reaped (the
kernel cannot reuse a PID before its parent reaps it), a foreign PID (a descendant found in /proc,
a process forked by a helper) only while /proc shows it alive and not a zombie. Every wait is
bounded. `stop` sends SIGCONT before SIGTERM: a stopped process (SIGSTOP: a hang fault) that
handles SIGTERM cannot run its handler until it is continued, so without SIGCONT every such stop
would sit out the whole grace period and end in SIGKILL, skipping the process's cleanup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# How long to wait for the kernel to reap a process after SIGKILL (it cannot ignore it; only a
# process stuck in uninterruptible I/O takes longer).
KILL_WAIT_S = 10.0


def start(cmd: Sequence[str], stdout: Path | None = None, stderr: Path | None = None, *,
          env: Mapping[str, str] | None = None, new_session: bool = True) -> subprocess.Popen:
    """Start `cmd` with stdin from /dev/null and output appended to files (stderr=None: to stdout).

    Files, never pipes: a pipe nobody reads fills up and blocks the child. `new_session` keeps a
    signal meant for the caller's terminal or process group (Ctrl-C) from reaching the child.
    """
    out = open(stdout, "ab") if stdout is not None else subprocess.DEVNULL
    err = open(stderr, "ab") if stderr is not None else subprocess.STDOUT
    try:
        return subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=None if env is None else dict(env),
                                start_new_session=new_session)
    finally:  # the child holds its own copies of the descriptors
        for f in (out, err):
            if not isinstance(f, int):
                f.close()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:  # not reaped yet: the PID is still this child's
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float = 5.0,
             sig: int = signal.SIGTERM) -> None:
    """End our children by PID: SIGCONT and `sig` to all, SIGKILL to those left after `grace_s`.

    All are signalled before any is waited for, so the grace periods run concurrently. Every
    process is reaped before this returns (or `KILL_WAIT_S` after its SIGKILL, at most).
    """
    for p in procs:
        _signal(p, signal.SIGCONT)
        _signal(p, sig)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=KILL_WAIT_S)


def stop(proc: subprocess.Popen, grace_s: float = 5.0, sig: int = signal.SIGTERM) -> int | None:
    """End one child by PID (see `stop_all`); return its exit code (None if it outlived SIGKILL)."""
    stop_all([proc], grace_s, sig)
    return proc.poll()


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of `pid`, read from /proc (empty where /proc is missing)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            # The command name in field 2 may hold spaces and ')': split after its last ')'.
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            parent[int(d.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (exited, not yet reaped: as good as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc: trust the signal probe
        return True


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL each PID of `pids` that is still alive (processes that are not our children)."""
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def stop_pids(pids: Sequence[int], grace_s: float = 5.0, poll_s: float = 0.02) -> None:
    """End processes that are not our children (we cannot wait() for them) by PID.

    SIGCONT and SIGTERM to each live one, then SIGKILL to those still alive after `grace_s`.
    Their parent reaps them; a zombie counts as ended.
    """
    for pid in pids:
        if alive(pid):
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(poll_s)
    kill_pids(pids)
