"""Process helpers of `bench/scale.py`: forking rank processes, ending them by PID, reading
their logs and their /proc figures.

Invariant: a forked child never returns into the caller's code (it leaves through os._exit, so it
never runs the parent's `finally` blocks); a PID is signalled only while its child is unreaped
(the kernel cannot reuse it before); every wait is bounded.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recover.procs import stop_pids


def fork_call(fn: Callable[[Any], Any], arg: Any, log: Path) -> int:
    """Fork a child that runs fn(arg) with stdout/stderr appended to `log`; return its PID.

    The child always leaves through os._exit, so it never runs this process's `finally`
    blocks (which would end its siblings)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack to log
        code = int(fn(arg) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Children:
    """Our forked children by name. A PID is signalled only until we reap it (the kernel cannot
    reuse an unreaped child's PID); every wait is bounded."""

    def __init__(self) -> None:
        self.pid: dict[Any, int] = {}
        self.code: dict[Any, int] = {}  # exit codes of reaped children

    def reap(self) -> None:
        for name, pid in self.pid.items():
            if name not in self.code:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.code[name] = os.waitstatus_to_exitcode(status)

    def unreaped(self) -> list[int]:
        return [p for n, p in self.pid.items() if n not in self.code]

    def stop(self, names: list[Any], grace_s: float = 5.0) -> None:
        self.reap()
        stop_pids([self.pid[n] for n in names if n not in self.code], grace_s=grace_s)
        deadline = time.monotonic() + 10.0
        while any(n not in self.code for n in names) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)


def dump_stacks(kids: Children, names: list[Any]) -> None:
    """Ask each live rank for its threads' stacks (in its .err log): why a run got stuck."""
    kids.reap()
    for n in names:
        if n not in kids.code:
            os.kill(kids.pid[n], signal.SIGUSR1)
    time.sleep(1.0)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc; every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pss_mib(pids: list[int]) -> tuple[float, float]:
    """(sum of proportional set sizes, max resident set size) of `pids`, MiB, from /proc."""
    total, top = 0.0, 0.0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in text.splitlines()[1:]}
        total += kb.get("Pss", 0) / 1024
        top = max(top, kb.get("Rss", 0) / 1024)
    return total, top


class Tail:
    """Reads the complete JSON lines appended to a log since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.recs = path, 0, []

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.recs
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        self.recs += [json.loads(ln) for ln in chunk[:end].splitlines() if ln.strip()]
        return self.recs

    def steps(self) -> list[dict]:
        return [r for r in self.read() if r.get("ev") == "step"]


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)
