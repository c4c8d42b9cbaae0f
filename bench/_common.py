"""Shared helpers of the benchmarks: processes (ended by PID), `recover train` runs, statistics.

Every wait here is bounded; every process a benchmark starts is ended in a `finally` by its PID
(and, for `recover train`, the launcher's own children by theirs).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


def say(msg: str) -> None:
    print(msg, flush=True)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def out_dir(arg: str | None, name: str) -> Path:
    path = Path(arg) if arg else Path(tempfile.mkdtemp(prefix=f"recover-bench-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def children(pid: int) -> list[int]:
    """PIDs of every live descendant of `pid` (read from /proc; empty where /proc is missing)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            parent[int(d.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def end(procs: list[subprocess.Popen], grace_s: float = 5.0, sig: int = signal.SIGTERM) -> None:
    """End processes we started, by PID: `sig`, then SIGKILL after `grace_s`; reap them."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads), from /proc; 0 if gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    state = Path(f"/proc/{pid}/stat")
    try:  # a zombie (exited, not yet reaped) counts as gone
        return state.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def end_pids(pids: list[int], grace_s: float = 5.0) -> None:
    """End processes that are not our children (forked by a helper), by PID."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    kill_pids([p for p in pids if alive(p)])


def kill_pids(pids: list[int]) -> None:
    """SIGKILL leftover descendants (by PID) of a process we started."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Sampler:
    """Samples, every `every_s`, how many steps a run has committed and each process's CPU clock.

    CPU seconds per step (processes' own clocks) are robust to other load on the machine, unlike
    wall time: they measure the work done, not the share of the cores the run was given.
    """

    def __init__(self, root_pid: int, metrics: Path, every_s: float = 0.05) -> None:
        self.root, self.metrics, self.every_s = root_pid, metrics, every_s
        self.kinds: dict[int, str] = {root_pid: "launcher"}
        self.samples: list[tuple[float, int, dict[int, float]]] = []
        self._offset, self._lines, self._scan = 0, 0, 0.0

    def sample(self) -> None:
        now = time.monotonic()
        if now - self._scan > 1.0:  # new processes: scanning /proc is the costly part
            self._scan = now
            for pid in children(self.root):
                if pid not in self.kinds:
                    try:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    except OSError:
                        continue
                    self.kinds[pid] = ("worker" if b"recover.train.worker" in cmd else
                                       "coordinator" if b"coordinator" in cmd else "other")
        try:
            with open(self.metrics, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            self._offset += len(chunk)
            self._lines += chunk.count(b"\n")
        except OSError:
            pass
        cpu = {pid: cpu_seconds(pid) for pid in self.kinds}
        self.samples.append((time.time(), self._lines, {p: c for p, c in cpu.items() if c}))

    def per_step(self, lo: int, hi: int, kinds: tuple[str, ...] = ("worker", "coordinator")
                 ) -> tuple[float, int]:
        """(CPU seconds per step of `kinds` from the commit of step lo-1 to that of hi-1, steps)."""
        a = next((x for x in self.samples if x[1] >= lo), None)
        b = next((x for x in self.samples if x[1] >= hi), None)
        if a is None or b is None or b[1] <= a[1]:
            return float("nan"), 0
        last: dict[int, float] = {}
        for _, _, cpu in self.samples[:self.samples.index(b) + 1]:
            last.update(cpu)  # a process that died in the window keeps its last clock
        total = sum(last.get(p, c) - c for p, c in a[2].items() if self.kinds[p] in kinds)
        total += sum(c for p, c in b[2].items() if p not in a[2] and self.kinds[p] in kinds)
        return total / (b[1] - a[1]), b[1] - a[1]


def recover_train(out: Path, preset: str, extra: list[str], timeout_s: float
                  ) -> tuple[list[dict], Sampler]:
    """Run `recover train` (a real coordinator + replica processes): its step records, CPU."""
    cmd = [sys.executable, "-m", "recover.cli", "train", "--preset", preset, "--out", str(out),
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(out.parent / f"{out.name}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    sampler = Sampler(proc.pid, out / "metrics.jsonl")
    kids: list[int] = []
    try:
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                say(f"  ! recover train exceeded {timeout_s:.0f}s; ending it (log {log.name})")
                break
            sampler.sample()
            time.sleep(sampler.every_s)
    finally:
        if proc.poll() is None:
            kids = children(proc.pid)
            end([proc], grace_s=10.0, sig=signal.SIGINT)  # SIGINT: its finally ends workers
        kill_pids(kids)
        log.close()
    if proc.returncode != 0:
        tail = Path(log.name).read_text(errors="replace")[-2000:]
        raise RuntimeError(f"recover train exited {proc.returncode}: {' '.join(cmd)}\n{tail}")
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()], sampler


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def periods(records: list[dict], lo: int, hi: int) -> list[float]:
    """Commit-to-commit intervals of steps lo..hi-1 (step s: time_s[s] - time_s[s-1]).

    The interval covers the whole loop (plan, compute, reduce, agreement, optimizer, record) and
    is what throughput sees; `step_time_s` (one replica's timer) misses the per-step bookkeeping.
    """
    t = {r["step"]: r["time_s"] for r in records}
    return [t[s] - t[s - 1] for s in range(max(lo, 1), hi) if s in t and s - 1 in t]


def field(records: list[dict], key: str, lo: int, hi: int) -> list[float]:
    return [float(r[key]) for r in records if lo <= r["step"] < hi]


def table(rows: list[tuple], head: tuple) -> None:
    cols = list(zip(head, *rows, strict=True))
    width = [max(len(str(c)) for c in col) for col in cols]
    for row in [head, *rows]:
        say("  " + "  ".join(str(c).rjust(w) for c, w in zip(row, width, strict=True)))
