"""Entry points that tests/test_procs.py forks through `recover.procs.Spawner` (argv[0]: a path).

Each writes what it observed about its own process as JSON to argv[0], then behaves as asked.
"""

from __future__ import annotations

import json
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import time
from pathlib import Path

from recover.procs import Spawner


def _dump(path: str, **extra: object) -> None:
    handlers = {name: repr(signal.getsignal(getattr(signal, name)))
                for name in ("SIGTERM", "SIGINT", "SIGCHLD", "SIGPIPE", "SIGUSR1")}
    rec = {"pid": os.getpid(), "ppid": os.getppid(),
           "threads": len(os.listdir("/proc/self/task")),
           "server_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
           "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
           "tracker_fd": multiprocessing.resource_tracker.getfd(),
           "stdin": os.readlink("/proc/self/fd/0"), "handlers": handlers,
           "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
           "env": os.environ.get("FS_TEST", ""), "cwd": os.getcwd(), "argv": sys.argv,
           "sid": os.getsid(0) == os.getpid(), **extra}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def probe(argv: list[str]) -> int:
    """Report, print to both streams, exit with argv[1]."""
    _dump(argv[0])
    print("to stdout")
    print("to stderr", file=sys.stderr)
    return int(argv[1])


def fail(argv: list[str]) -> None:
    raise ValueError(f"failing on purpose: {argv[1]}")


def leave(argv: list[str]) -> None:
    sys.exit(argv[1])


def sleeper(argv: list[str]) -> int:
    """Connect to the test's listener at argv[1] (a liveness socket), report, then sleep."""
    sock = socket.create_connection(("127.0.0.1", int(argv[1])), timeout=30)
    sock.sendall(b"hello\n")
    _dump(argv[0])
    time.sleep(120)
    return 0


def parent(argv: list[str]) -> int:
    """A spawning process (as a launcher is): fork a sleeper through its own spawner, report the
    sleeper's PID, then sleep until the test kills this process."""
    spawner = Spawner(("_fs_entries",))
    kid = spawner.start("_fs_entries:sleeper", [argv[0] + ".kid", argv[1]], argv[0] + ".log")
    deadline = time.monotonic() + 60
    while not Path(argv[0] + ".kid").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    _dump(argv[0], kid=kid.pid)
    time.sleep(120)
    return 0
