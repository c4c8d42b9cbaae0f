"""A fork server for `bench/recovery.py`: imports torch and recover once, then forks processes.

Each line on stdin is a JSON request {"module": "selftest" | "coordinator", "argv": [...],
"log": path}; the server forks a child that runs `recover.collectives.<module>.main(argv)` with
stdout and stderr appended to `log`, and answers the child's PID on stdout. Children are real,
separate processes (a SIGKILL of one is a real crash); forking skips a ~3 CPU-second torch import
per process. The server exits at EOF; the caller ends the children by PID. No thread is started
before a fork.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import traceback

import torch  # noqa: F401  (imported once, shared by every child)

from recover.collectives import coordinator, selftest

MODULES = {"selftest": selftest, "coordinator": coordinator}


def child(req: dict) -> int:
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps every thread's stack to log
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        return int(MODULES[req["module"]].main(req["argv"]) or 0)
    except SystemExit as e:
        return int(e.code or 0) if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = child(req)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
