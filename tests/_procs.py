"""Start and stop test processes by PID (never by name).

Every process gets its own session (so a signal meant for the test runner never reaches it) and
its stdout/stderr go to files (a full pipe can never block it). `stop` ends one process by its PID:
SIGCONT first (a stopped process ignores SIGTERM until continued), then SIGTERM, then SIGKILL.

Python entry points (`module:function(argv)`) are forked by one fork server per test session
(`session_server()`, recover's own `recover.app.train.forkserver`), which imported torch once: each
process is still real and separate, but skips a ~3 CPU-s import. `RECOVER_FORKSERVER=0` makes every
one a fresh `python -m module` instead. The server is ended by PID at the end of the session.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from recover.app.train import forkserver
from recover.app.train.forkserver import PRELOAD, PRELOAD_OPTIONAL, ForkServer, Process

TESTS = Path(__file__).resolve().parent

_SERVER: list[ForkServer] = []  # the session's fork server, started on first use


def session_server() -> ForkServer | None:
    """The test session's fork server (None where fork servers are disabled)."""
    if not forkserver.enabled():
        return None
    if not _SERVER:
        # recover.app.cli too: `recover train` launchers are forked here (tests/_run.py); and the
        # tests folder on the path, for entry points of the tests' own (tests/_fs_entries.py).
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), old]))
        try:
            _SERVER.append(ForkServer(("recover.app.cli", "recover.app.train.launch", "_fs_entries",
                                       *PRELOAD, *PRELOAD_OPTIONAL)).start())
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        atexit.register(close_session_server)
    return _SERVER[0]


def close_session_server() -> None:
    while _SERVER:
        _SERVER.pop().close()


def start(entry: str, argv: list[str], stdout: Path, stderr: Path,
          env: dict[str, str] | None = None) -> Process:
    """Start `entry` ("module:function") in a new session: forked, or `python -m module`."""
    server = session_server()
    if server is not None:
        return server.spawn(entry, argv, stdout, stderr, env=env, new_session=True)
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        return subprocess.Popen([sys.executable, "-m", entry.partition(":")[0], *argv],
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


class Proc:
    """A started process (forked by the session's fork server, or a subprocess) with its name and
    output files."""

    def __init__(self, name: str, entry: str, argv: list[str], out_dir: Path,
                 env: dict[str, str] | None = None):
        self.name, self.entry, self.argv = name, entry, argv
        self.stdout_path = out_dir / f"{name}.out"
        self.stderr_path = out_dir / f"{name}.err"
        self.popen = start(entry, argv, self.stdout_path, self.stderr_path, env)
        self.pid = self.popen.pid
        self.exited_at: float | None = None  # time.time() when first seen exited

    @classmethod
    def command(cls, name: str, cmd: list[str], out_dir: Path,
                env: dict[str, str] | None = None) -> Proc:
        """A plain command (e.g. under `ip netns exec`), started in its own session."""
        self = cls.__new__(cls)
        self.name, self.entry, self.argv = name, cmd[0], cmd[1:]
        self.stdout_path = out_dir / f"{name}.out"
        self.stderr_path = out_dir / f"{name}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                          env=env, start_new_session=True)
        self.pid = self.popen.pid
        self.exited_at = None
        return self

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
            self.popen.send_signal(sig)

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
