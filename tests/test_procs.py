"""`recover.procs`: ending processes by PID (stopped and stubborn ones too) in bounded time.

Each test starts a few short Python processes and checks how (and how fast) they end; every
process is ended in a `finally` by PID, whatever the assertions said.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recover.procs import alive, descendants, kill_pids, start, stop, stop_all, stop_pids

pytestmark = pytest.mark.timeout(120)

SLEEP = "import time; print('up', flush=True); time.sleep(60)"
# Handles SIGTERM (as a trainer that cleans up would): exit code 7 proves the handler ran.
HANDLER = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); "
           "print('up', flush=True); time.sleep(60)")
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)")


def started(cmd: str, log: Path) -> subprocess.Popen:
    """Start `python -c cmd` and wait (bounded) until it has printed 'up'."""
    proc = start([sys.executable, "-c", cmd], log)
    deadline = time.monotonic() + 30
    while b"up" not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    return proc


def test_stopped_process_runs_its_sigterm_handler(tmp_path: Path) -> None:
    proc = started(HANDLER, tmp_path / "a.log")
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # a hang fault: a handler cannot run until SIGCONT
        t0 = time.monotonic()
        assert stop(proc, grace_s=20.0) == 7
        assert time.monotonic() - t0 < 10.0  # did not sit out the grace period
    finally:
        stop(proc, grace_s=0.0)


def test_sigterm_ignored_gets_sigkill_after_grace(tmp_path: Path) -> None:
    procs = [started(STUBBORN, tmp_path / "b.log"), started(SLEEP, tmp_path / "c.log")]
    try:
        t0 = time.monotonic()
        stop_all(procs, grace_s=0.5)
        assert time.monotonic() - t0 >= 0.5
        assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGTERM]
    finally:
        stop_all(procs, grace_s=0.0)


def test_descendants_and_foreign_pids(tmp_path: Path) -> None:
    # A parent that starts a grandchild and reports its PID: the grandchild is not our child.
    parent_cmd = ("import subprocess, sys, time; "
                  f"c = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); "
                  "print('up', c.pid, flush=True); time.sleep(60)")
    parent = started(parent_cmd, tmp_path / "p.log")
    grandchild = int((tmp_path / "p.log").read_text().split()[1])
    try:
        assert descendants(parent.pid) == [grandchild]
        assert alive(grandchild)
        t0 = time.monotonic()
        stop_pids([grandchild], grace_s=0.5)  # ignores SIGTERM: SIGKILL, reaped by its parent
        assert time.monotonic() - t0 < 10.0
        assert not alive(grandchild)  # gone, or a zombie its sleeping parent has not reaped
        assert stop(parent, grace_s=5.0) == -signal.SIGTERM
        assert descendants(parent.pid) == []
    finally:
        kill_pids([grandchild])
        stop(parent, grace_s=0.0)

