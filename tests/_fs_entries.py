"""Entry points forked by tests/test_forkserver.py (`module:function(argv)`, argv[0] = an out path).

Each writes what it observed about its own process as JSON to argv[0], then behaves as asked.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from recover.app.train import forkserver


def _dump(path: str, **extra: object) -> None:
    handlers = {name: repr(signal.getsignal(getattr(signal, name)))
                for name in ("SIGTERM", "SIGINT", "SIGCHLD", "SIGPIPE", "SIGUSR1")}
    rec = {"pid": os.getpid(), "ppid": os.getppid(), "threads": forkserver.thread_count(),
           "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
           "stdin": os.readlink("/proc/self/fd/0"), "handlers": handlers,
           "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
           "env": os.environ.get("FS_TEST", ""), "cwd": os.getcwd(), "argv": sys.argv,
           "in_child": forkserver.IN_CHILD, "sid": os.getsid(0) == os.getpid(), **extra}
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


def nested(argv: list[str]) -> int:
    """Start a fork server from inside a forked child; fork a probe through it; report both."""
    server = forkserver.ForkServer().start()
    try:
        child = server.spawn("_fs_entries:probe", [argv[0] + ".inner", "0"], argv[0] + ".log")
        code = child.wait(60)
        _dump(argv[0], server_pid=server.pid, forked=server.forked,
              inner_code=code)
    finally:
        server.close()
    return 0
