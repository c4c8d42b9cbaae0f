"""`recover train` as a real process tree, and what it wrote: the run helpers of tests and benches.

Invariant: a `Launch` starts one `recover train` (or `recover bench`) launcher in its own session,
forked by the session's spawner (`harness.processes`: torch already imported) or, with
`fresh=True` or `RECOVER_FORKSERVER=0`, as a fresh `python -m recover`; its stdout and stderr go to
files next to the run directory (`<out>.launcher.out`, `.err`); a train run writes no end-of-run
report unless asked (`report=True`). Whatever happens, the launcher is
ended by its PID and so is every process it had started (found in /proc before the launcher is
ended: its descendants); every wait is bounded. `own_loop` runs a coordinator and a user's own
loops the same way, without the launcher. `fresh_dir` gives a bench its own empty folder.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.processes import session
from recover import procs
from recover.app import rundir
from recover.procs import Process

# The common small config of the multi-process tests: fast on 2 cores, enough steps to see drift.
BASE = ["--preset", "debug", "--steps", "14", "--eval-every", "0", "--warmup-steps", "3"]
# The multi-rank layouts' short runs (tests/test_layouts.py, tests/test_checkpoint.py), which all
# follow one single-replica reference. SIGKILL is seen through the liveness socket at once; the
# heartbeat threshold only matters for hangs, and a loaded 2-core machine can starve a heartbeat
# thread for over a second: hence 3 s.
LAYOUT_STEPS = 6
LAYOUT_ARGS = ["--preset", "debug", "--steps", str(LAYOUT_STEPS), "--eval-every", "0",
               "--warmup-steps", "3", "--stale-s", "3"]
LAYOUT_FLAGS = {"hsdp": ["--layout", "hsdp", "--shards", "2"],
                "tp": ["--layout", "tp", "--tp", "2"], "pp": ["--layout", "pp", "--stages", "2"]}


def read_jsonl(path: Path) -> list[dict]:
    """Every complete JSON line of `path` (metrics.jsonl, coordinator.jsonl): the app's reader."""
    return rundir.read_jsonl(path)


def fresh_dir(path: Path) -> Path:
    """An empty folder at `path`: the logs a run appends to and the port files it takes as found
    would otherwise feed an earlier run's generations, steps and dead ports into this one."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 all free right now, for a process told its port ahead of
    time (a coordinator's `--port`, torchrun's master port). Drawn below the kernel's ephemeral
    range: a port that bind(0) handed out and gave back can be handed to any other socket (a
    gloo pair, another test's store) before its process binds it, and then that process cannot
    listen (seen in CI: a coordinator's port taken, its workers retrying a stranger's for 120 s).
    Two callers drawing the same port at once is still possible, and far less likely."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low - count))
        try:
            with contextlib.ExitStack() as stack:
                for k in range(count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("0.0.0.0", port + k))
            return port
        except OSError:
            continue
    raise AssertionError(f"no {count} consecutive free ports below {low}")


def two_free_ports() -> int:
    """A port P with P and P + 1 both free (a coordinator on a fixed port binds both:
    `--external-workers` needs one the replicas are told ahead of time)."""
    return free_ports(2)


def _ephemeral_low() -> int:
    """The first port of Linux's ip_local_port_range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    def metrics(self) -> list[dict]:
        return read_jsonl(self.out / rundir.METRICS)

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.metrics()]

    def final(self, replica: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / rundir.FINAL / rundir.final_params(replica), weights_only=True)

    def finals(self) -> dict[int, dict[str, torch.Tensor]]:
        return {int(p.stem.removeprefix("replica")): torch.load(p, weights_only=True)
                for p in sorted((self.out / rundir.FINAL).glob(rundir.FINAL_GLOB))}

    def log(self, replica: int) -> str:
        return (self.out / rundir.LOGS / rundir.replica_log(replica)).read_text(errors="replace")


class Launch:
    """A started `recover train` (`command="bench"`: `recover bench`); `finish()` waits for it."""

    def __init__(self, out: Path, *args: str, data: Path | None = None, fresh: bool = False,
                 env: Mapping[str, str] | None = None, command: str = "train",
                 report: bool = False) -> None:
        argv = [command, "--out", str(out), *args]
        if command == "train" and not report:
            argv.append("--no-report")  # ~1 s of matplotlib per run, x the suite's ~100 runs
        if command == "train" and "--tensorboard" not in args:
            # 0.3 s of the launcher's CPU per run; the tests of the writers ask for it by name.
            argv += ["--tensorboard", "none"]
        if data is not None:
            argv += ["--data", str(data)]
        self.out, self.argv = out, argv
        self.stdout_path = out.parent / f"{out.name}.launcher.out"
        self.stderr_path = out.parent / f"{out.name}.launcher.err"
        for path in (self.stdout_path, self.stderr_path):  # an earlier launch's, if any
            path.unlink(missing_ok=True)
        if fresh:
            self.proc: Process = procs.start([sys.executable, "-m", "recover", *argv],
                                             self.stdout_path, self.stderr_path, env=env)
        else:
            self.proc = session().start("recover.app.cli:main", argv, self.stdout_path,
                                        self.stderr_path, env=env, new_session=True)
        self.pid = self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def end(self, grace_s: float = 10.0) -> None:
        """End the launcher by PID (SIGINT: its own cleanup ends its processes), then every
        descendant it left."""
        kids = procs.descendants(self.pid)
        procs.stop(self.proc, grace_s, sig=signal.SIGINT)
        procs.kill_pids(kids)

    def finish(self, timeout: float = 240) -> Run:
        """Wait (bounded) for the launcher to exit; what it wrote. On timeout it is ended and
        the test fails."""
        if procs.wait_exit(self.proc, timeout) is None:
            self.end(grace_s=0.0)
            raise AssertionError(f"recover {self.argv[0]} timed out after {timeout}s:\n"
                                 f"{self.stderr()[-3000:]}")
        assert self.proc.returncode is not None
        return Run(self.proc.returncode, self.stdout_path.read_text(errors="replace"),
                   self.stderr(), self.out)


def recover_train(out: Path, *args: str, data: Path | None = None, timeout: float = 240,
                  fresh: bool = False, env: Mapping[str, str] | None = None) -> Run:
    """Run `recover train` to the end (see `Launch`)."""
    return Launch(out, *args, data=data, fresh=fresh, env=env).finish(timeout)


def own_loop(out: Path, worker: Callable[[int], list[str]], replicas: int, timeout_s: float,
             env: Mapping[str, str] | None = None) -> None:
    """A run without the launcher: `recover coordinator` (stale_s 5, its log and output in `out`)
    and one process per replica, `worker(r) + ["--port", P]` (a loop of a user's own on
    `recover.Replica`), each to exit 0 within `timeout_s` (else AssertionError with its output's
    tail, `out/worker{r}.out`). Every process is ended by its PID, whatever happens."""
    port_file = out / "port"
    coord = procs.start([sys.executable, "-m", "recover", "coordinator", "--replicas",
                         str(replicas), "--port", "0", "--port-file", str(port_file),
                         "--stale-s", "5", "--exit-when-done",
                         "--log", str(out / rundir.COORDINATOR_LOG)],
                        out / "coordinator.out", env=env)
    workers: list[Process] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not port_file.exists() or not port_file.read_text().strip():
            assert coord.poll() is None, (out / "coordinator.out").read_text()
            assert time.monotonic() < deadline, "the coordinator wrote no port"
            time.sleep(0.05)
        port = port_file.read_text().strip()
        for r in range(replicas):
            workers.append(procs.start([*worker(r), "--port", port], out / f"worker{r}.out",
                                       env=env))
        for r, w in enumerate(workers):
            code = procs.wait_exit(w, max(1.0, deadline - time.monotonic()))
            assert code == 0, (r, code, (out / f"worker{r}.out").read_text()[-3000:])
    finally:
        procs.stop_all([*workers, coord])


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_rel(xs: list[float], ys: list[float]) -> float:
    assert len(xs) == len(ys), (len(xs), len(ys))
    return max(abs(x - y) / abs(y) for x, y in zip(xs, ys, strict=True))
