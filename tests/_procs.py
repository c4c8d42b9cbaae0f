"""Start and stop test subprocesses by PID (never by name).

Every process gets its own session (so a signal meant for the test runner never reaches it) and
its stdout/stderr go to files (a full pipe can never block it). `stop` ends one process by its PID:
SIGCONT first (a stopped process ignores SIGTERM until continued), then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


class Proc:
    """A started subprocess with its name and output files."""

    def __init__(self, name: str, cmd: list[str], out_dir: Path, env: dict[str, str] | None = None):
        self.name, self.cmd = name, cmd
        self.stdout_path = out_dir / f"{name}.out"
        self.stderr_path = out_dir / f"{name}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                          env=env, start_new_session=True)
        self.pid = self.popen.pid
        self.exited_at: float | None = None  # time.time() when first seen exited

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.exited_at is None:
            self.exited_at = time.time()
        return rc

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def alive(self) -> bool:
        return self.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to this PID; a no-op once the process has been reaped (no PID reuse)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float, poll_s: float = 0.005) -> int | None:
        """Wait up to `timeout` seconds; return the exit code, or None if still running."""
        deadline = time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None or time.monotonic() >= deadline:
                return rc
            time.sleep(poll_s)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")


def stop(proc: Proc, grace_s: float = 5.0) -> int | None:
    """End `proc` by PID: SIGCONT, SIGTERM, then SIGKILL after `grace_s`; reap it."""
    if proc.poll() is not None:
        return proc.returncode
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            proc.signal(sig)
        except ProcessLookupError:
            break
    if proc.wait(grace_s) is None:
        with contextlib.suppress(ProcessLookupError):
            proc.signal(signal.SIGKILL)
        proc.wait(30.0)
    return proc.poll()


def stop_all(procs: list[Proc], grace_s: float = 5.0) -> None:
    """Stop every process of `procs` (each by its own PID), most recently started first."""
    for proc in reversed(procs):
        stop(proc, grace_s)
