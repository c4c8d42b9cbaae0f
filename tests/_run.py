"""Helpers to run `recover train` as a real process tree and read what it wrote.

The launcher (`recover.cli:main(["train", ...])`) is forked by the session's fork server
(tests/_procs.py), so it starts with torch imported and, being a single-threaded fork-server child,
forks its own fork server from itself: no process of the tree imports torch again. `fresh=True`
(or `RECOVER_FORKSERVER=0`) runs `python -m recover train` instead. Every run is started in its
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
from recover.train.forkserver import Process

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


def recover_train(out: Path, *args: str, data: Path | None = None, timeout: float = 240,
                  fresh: bool = False) -> Run:
    argv = ["train", "--out", str(out), *args]
    if data is not None:
        argv += ["--data", str(data)]
    server = None if fresh else session_server()
    if server is None:
        proc: Process = subprocess.Popen([sys.executable, "-m", "recover", *argv],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, start_new_session=True)
    else:
        logs = out.parent / f"{out.name}.launcher"
        proc = server.spawn("recover.cli:main", argv, f"{logs}.out", f"{logs}.err",
                            new_session=True)
    try:
        if isinstance(proc, subprocess.Popen):
            stdout, stderr = proc.communicate(timeout=timeout)
        else:
            proc.wait(timeout)
            stdout, stderr = (Path(f"{logs}.{x}").read_text(errors="replace")
                              for x in ("out", "err"))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        if isinstance(proc, subprocess.Popen):
            stderr = proc.communicate(timeout=30)[1]
        else:
            proc.wait(30)
            stderr = Path(f"{logs}.err").read_text(errors="replace")
        raise AssertionError(f"recover train timed out after {timeout}s:\n{stderr[-3000:]}"
                             ) from None
    finally:
        try:  # anything the run left behind in its session (e.g. a stopped replica)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode is not None
    return Run(proc.returncode, stdout, stderr, out)


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_rel(xs: list[float], ys: list[float]) -> float:
    assert len(xs) == len(ys), (len(xs), len(ys))
    return max(abs(x - y) / abs(y) for x, y in zip(xs, ys, strict=True))
