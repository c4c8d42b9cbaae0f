"""Helpers to run `recover train` as a real process tree and read what it wrote.

The launcher (`recover.app.cli:main(["train", ...])`) is forked by the session's fork server
(tests/_procs.py), so it starts with torch imported and, being a single-threaded fork-server child,
forks its own fork server from itself: no process of the tree imports torch again. `fresh=True`
(or `RECOVER_FORKSERVER=0`) runs `python -m recover train` instead. Its stdout and stderr go to
files next to the run directory (`<out>.launcher.out/.err`). Every run is started in its
own session so that, on timeout, the whole tree (launcher, its fork server, coordinator, replicas)
is ended by its process-group id, never by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from _procs import session_server
from recover.app.train.forkserver import Process

# The common small config of the multi-process tests: fast on 2 cores, enough steps to see drift.
BASE = ["--preset", "debug", "--steps", "14", "--eval-every", "0", "--warmup-steps", "3"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    def metrics(self) -> list[dict]:
        with open(self.out / "metrics.jsonl") as f:
            return [json.loads(line) for line in f if line.strip()]

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.metrics()]

    def final(self, replica: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / "final" / f"replica{replica}.pt", weights_only=True)

    def finals(self) -> dict[int, dict[str, torch.Tensor]]:
        return {int(p.stem.removeprefix("replica")): torch.load(p, weights_only=True)
                for p in sorted((self.out / "final").glob("replica*.pt"))}

    def log(self, replica: int) -> str:
        return (self.out / "logs" / f"replica{replica}.log").read_text(errors="replace")


class Launch:
    """A started `recover train` (forked from the session's server, or `python -m recover`), its
    output in files next to its run directory; `finish()` waits and ends its session.
    `command="bench"` runs `recover bench` instead."""

    def __init__(self, out: Path, *args: str, data: Path | None = None, fresh: bool = False,
                 env: dict[str, str] | None = None, command: str = "train") -> None:
        argv = [command, "--out", str(out), *args]
        if data is not None:
            argv += ["--data", str(data)]
        self.out, self.argv = out, argv
        self.stdout_path = out.parent / f"{out.name}.launcher.out"
        self.stderr_path = out.parent / f"{out.name}.launcher.err"
        server = None if fresh else session_server()
        if server is None:
            with open(self.stdout_path, "wb") as o, open(self.stderr_path, "wb") as e:
                self.proc: Process = subprocess.Popen(
                    [sys.executable, "-m", "recover", *argv], stdout=o, stderr=e,
                    stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        else:
            self.proc = server.spawn("recover.app.cli:main", argv, self.stdout_path,
                                     self.stderr_path, env=env, new_session=True)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def finish(self, timeout: float = 240) -> Run:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            raise AssertionError(f"recover {self.argv[0]} timed out after {timeout}s:\n"
                                 f"{self.stderr()[-3000:]}") from None
        finally:
            try:  # anything the run left behind in its session (e.g. a stopped replica)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert self.proc.returncode is not None
        return Run(self.proc.returncode, self.stdout_path.read_text(errors="replace"),
                   self.stderr(), self.out)


def recover_train(out: Path, *args: str, data: Path | None = None, timeout: float = 240,
                  fresh: bool = False, env: dict[str, str] | None = None) -> Run:
    """Run `recover train` to the end (see `Launch`)."""
    return Launch(out, *args, data=data, fresh=fresh, env=env).finish(timeout)


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_rel(xs: list[float], ys: list[float]) -> float:
    assert len(xs) == len(ys), (len(xs), len(ys))
    return max(abs(x - y) / abs(y) for x, y in zip(xs, ys, strict=True))
