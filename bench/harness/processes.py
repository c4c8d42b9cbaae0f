"""Named test processes with their log files, started and ended by PID (through `recover.procs`).

Invariant: every process gets its own session (a signal meant for the test runner never reaches
it), its stdout and stderr go to files (`<dir>/<name>.out`, `.err`: a full pipe can never block
it), and it is ended by its PID: SIGCONT first (a stopped process ignores SIGTERM until
continued), then SIGTERM, then SIGKILL. Python entry points ("module:function") are forked by one
`recover.procs.Spawner` per session (`session()`), whose fork server imported torch and the app
once: each process is still real and separate, but skips a ~2 CPU-s import.
`RECOVER_FORKSERVER=0` makes every one a fresh `python -m module` instead. `close_session()` ends
whatever the session's spawner started that still runs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from recover import procs
from recover.app.train.launch import PRELOAD as APP_PRELOAD
from recover.procs import Process, Spawner

# What the session's fork server imports: the CLI (tests fork `recover train` launchers), the
# processes a launch starts, the harness itself, and TensorBoard's writer (on by default in every
# launcher: imported once here, not once per run).
PRELOAD = ("recover.app.cli", "recover.app.train.launch", *APP_PRELOAD, "harness.runs",
           "torch.utils.tensorboard")

_SESSION: list[Spawner] = []  # the session's spawner, made on first use


def session() -> Spawner:
    """The test session's spawner (one per process; its fork server starts on first use)."""
    if not _SESSION:
        _SESSION.append(Spawner(PRELOAD))
    return _SESSION[0]


def close_session(grace_s: float = 5.0) -> None:
    """End, by PID, every process the session's spawner started that still runs."""
    while _SESSION:
        _SESSION.pop().close(grace_s)


class Proc:
    """A started process with its name and output files; `wait` returns None while it runs."""

    def __init__(self, name: str, entry: str, argv: Sequence[str], out_dir: Path,
                 env: Mapping[str, str] | None = None) -> None:
        """Start `entry` ("module:function") with `argv`, forked by the session's spawner."""
        self.name = name
        self.stdout_path = out_dir / f"{name}.out"
        self.stderr_path = out_dir / f"{name}.err"
        self.popen: Process = session().start(entry, argv, self.stdout_path, self.stderr_path,
                                              env=env, new_session=True)
        self.pid = self.popen.pid
        self.exited_at: float | None = None  # time.time() when first seen exited

    @classmethod
    def command(cls, name: str, cmd: Sequence[str], out_dir: Path,
                env: Mapping[str, str] | None = None) -> Proc:
        """A plain command (e.g. under `ip netns exec`), started in its own session."""
        self = cls.__new__(cls)
        self.name = name
        self.stdout_path = out_dir / f"{name}.out"
        self.stderr_path = out_dir / f"{name}.err"
        self.popen = procs.start(cmd, self.stdout_path, self.stderr_path, env=env)
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
        """Send `sig` to this process; a no-op once it has exited (never a recycled PID)."""
        if self.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float, poll_s: float = 0.005) -> int | None:
        """Wait up to `timeout` seconds; the exit code, or None if it still runs."""
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
    """End `proc` by PID (`recover.procs.stop`); its exit code."""
    procs.stop(proc.popen, grace_s)
    return proc.poll()


def stop_all(started: Sequence[Proc], grace_s: float = 5.0) -> None:
    """End every process of `started` by its PID, all signalled at once (procs.stop_all)."""
    procs.stop_all([p.popen for p in reversed(started)], grace_s)
    for p in started:
        p.poll()
