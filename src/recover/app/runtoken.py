"""The run's secret: one random token per run directory, the key that authenticates its files.

Invariant: every process of one run gets the same token from `run_token(run_dir)`: the env
`RECOVER_RUN_TOKEN` if set (a cluster whose nodes share no filesystem, or a secret manager), else
`run_dir/run.token`, which `recover train` creates once (mode 0600, never rewritten). A process
without either gets a `ConfigError`, never a made-up token: a wrong key must fail loudly, not
silently mark every checkpoint as tampered. A resumed run never makes a token (`resume_token`):
a new one would authenticate none of the run's files. This is the only place that knows where the
token comes from. The file is read without blocking (a FIFO at its path is refused, never
waited on) and must be UTF-8 text: anything else is one `ConfigError` line.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from recover.app.rundir import RUN_TOKEN
from recover.errors import ConfigError
from recover.settings import LaunchEnv

ENV = "RECOVER_RUN_TOKEN"  # read by LaunchEnv; named here in messages
FILE = RUN_TOKEN  # in the run directory
MAX_BYTES = 4096  # a token is 64 hex digits; a longer file is not one


def run_token(run_dir: str | Path, create: bool = False) -> bytes:
    """This run's token (bytes). With `create` (the launcher), make `run_dir/run.token` first if
    neither it nor the env variable exists."""
    env = LaunchEnv.from_env().token
    if env:
        return env.encode()
    path = Path(run_dir) / FILE
    if create and not path.exists():
        _create(path)
    return _read(path).encode()


def _read(path: Path) -> str:
    """The token in `path`: a regular file of UTF-8 text (at most MAX_BYTES); anything else
    (missing, a FIFO or device that could block, too long, not text) is one ConfigError line."""
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, for ever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"no run token: {path} is missing and {ENV} is not set (recover train "
                          "creates it; give external workers the run directory or the env)"
                          ) from None
    except OSError as e:
        raise ConfigError(f"cannot read the run token {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"the run token {path} is not a regular file")
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read the run token {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"the run token {path} is longer than {MAX_BYTES} bytes: not a token")
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ConfigError(f"the run token {path} is not UTF-8 text (byte {e.start}; recover "
                          "train writes 64 hex digits)") from None
    if not token:
        raise ConfigError(f"the run token {path} is empty")
    return token


def resume_token(run_dir: str | Path) -> bytes:
    """The token of a run being resumed: `run_token` without `create`, and a missing one named
    as what `--resume` needs (one line), never made up."""
    path = Path(run_dir) / FILE
    if not LaunchEnv.from_env().token and not path.exists():
        raise ConfigError(f"--resume: no run token: {path} is missing and {ENV} is not set; the "
                          "run's checkpoints are signed with the token it started with: restore "
                          f"{FILE}, or set {ENV} to that token")
    return run_token(run_dir)


def _create(path: Path) -> None:
    token = secrets.token_hex(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # O_EXCL: two launchers racing on one directory keep the first token, never mix them.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
