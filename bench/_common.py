"""Shared helpers of the benchmarks: `recover train` runs with their CPU clocks, statistics, tables.

Every wait here is bounded; every process a benchmark starts is ended in a `finally` by its PID
(and, for `recover train`, the launcher's own children by theirs): `recover train` runs through
the test harness's `harness.runs.Launch`, the one way tests and benches run it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from harness.runs import Launch, fresh_dir
from recover.app import rundir
from recover.procs import descendants

__all__ = ["BENCH_DIR", "Sampler", "bench_args", "cores", "cpu_seconds", "defaults", "field",
           "fresh_dir", "loadavg", "log_progress", "median", "out_dir", "peak_rss", "periods",
           "recover_train", "say", "table"]

BENCH_DIR = Path(__file__).resolve().parent


def say(msg: str) -> None:
    """A line of the bench's report (stdout); progress lines go through `logging` (stderr)."""
    print(msg, flush=True)


def log_progress() -> None:
    """Route the bench's progress lines (its `logging.getLogger("bench.<script>")`) to stderr."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def bench_args(doc: str, quick: str, smoke: str) -> argparse.ArgumentParser:
    """A bench's parser with the flags every bench takes (--quick, --smoke, --out); its first
    line of `doc` is the description. Sets up the progress lines' logging too."""
    log_progress()
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--smoke", action="store_true", help=f"{smoke} (a few seconds; CI runs it)")
    ap.add_argument("--out", help="folder for logs and results (default: a new temp dir)")
    return ap


def defaults(args: argparse.Namespace, values: dict[str, object]) -> argparse.Namespace:
    """Each of `values` where the command line left it None (a mode's defaults)."""
    for key, value in values.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads), from /proc; 0 if gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def peak_rss(pid: int) -> int:
    """A live process's resident-set high-water mark (VmHWM), in bytes; 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def process_kind(pid: int) -> str:
    """What a process of a `recover train` run is, by the log its stdout goes to (forked
    processes share their fork server's command line): "worker", "coordinator", "other"; "" if
    it is gone."""
    try:
        out = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""
    name = Path(out).name
    return ("worker" if name.startswith("replica") else
            "coordinator" if name == "coordinator.log" else "other")


class Sampler:
    """Samples, every `every_s`, how many steps a run has committed and each process's CPU clock.

    CPU seconds per step (processes' own clocks) are robust to other load on the machine, unlike
    wall time: they measure the work done, not the share of the cores the run was given.
    """

    def __init__(self, root_pid: int, metrics: Path, every_s: float = 0.05) -> None:
        self.root, self.metrics, self.every_s = root_pid, metrics, every_s
        self.kinds: dict[int, str] = {root_pid: "launcher"}
        self.samples: list[tuple[float, int, dict[int, float]]] = []
        self.peak_rss: dict[int, int] = {}  # pid -> the kernel's high-water mark (VmHWM), bytes
        self._offset, self._lines, self._scan = 0, 0, 0.0

    def sample(self) -> None:
        now = time.monotonic()
        # New processes: scanning /proc is the costly part, so once a second; but every sample
        # until a worker is known, or a fast run's first steps pass with no clock of its workers.
        known = any(k == "worker" for k in self.kinds.values())
        if not known or now - self._scan > 1.0:
            self._scan = now
            for pid in descendants(self.root):
                if pid not in self.kinds:
                    kind = process_kind(pid)  # "other" may be a fork not yet redirected: later
                    if kind in ("worker", "coordinator"):
                        self.kinds[pid] = kind
        try:
            with open(self.metrics, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            self._offset += len(chunk)
            self._lines += chunk.count(b"\n")
        except OSError:
            pass
        cpu = {pid: cpu_seconds(pid) for pid in self.kinds}
        for pid, kind in self.kinds.items():
            if kind == "worker":  # the kernel keeps the peak: a late sample loses nothing
                self.peak_rss[pid] = max(self.peak_rss.get(pid, 0), peak_rss(pid))
        self.samples.append((time.time(), self._lines, {p: c for p, c in cpu.items() if c}))

    def per_step(self, lo: int, hi: int, kinds: tuple[str, ...] = ("worker", "coordinator")
                 ) -> tuple[float, int]:
        """(CPU seconds per step of `kinds` from the commit of step lo-1 to that of hi-1, steps)."""
        a = next((x for x in self.samples if x[1] >= lo), None)
        b = next((x for x in self.samples if x[1] >= hi), None)
        if a is None or b is None or b[1] <= a[1]:
            return float("nan"), 0
        if not any(self.kinds[p] in kinds for p in a[2]):  # none was known yet: not measured
            return float("nan"), 0
        last: dict[int, float] = {}
        for _, _, cpu in self.samples[:self.samples.index(b) + 1]:
            last.update(cpu)  # a process that died in the window keeps its last clock
        total = sum(last.get(p, c) - c for p, c in a[2].items() if self.kinds[p] in kinds)
        total += sum(c for p, c in b[2].items() if p not in a[2] and self.kinds[p] in kinds)
        return total / (b[1] - a[1]), b[1] - a[1]


def recover_train(out: Path, preset: str, extra: list[str], timeout_s: float
                  ) -> tuple[list[dict], Sampler]:
    """Run `recover train` (a fresh launcher: a real coordinator + replica processes) in a fresh
    folder: its step records, and the CPU clocks of its processes."""
    fresh_dir(out)  # `recover train` refuses a folder that holds a run (a reused --out)
    run = Launch(out, "--preset", preset, *extra, fresh=True,
                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    sampler = Sampler(run.pid, out / rundir.METRICS)
    try:
        deadline = time.monotonic() + timeout_s
        while run.running():
            if time.monotonic() > deadline:
                say(f"  ! recover train exceeded {timeout_s:.0f}s; ending it "
                    f"(log {run.stderr_path})")
                break
            sampler.sample()
            time.sleep(sampler.every_s)
    finally:
        if run.running():
            run.end()  # SIGINT: its own cleanup ends its processes; then its descendants
    result = run.finish(timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"recover train exited {result.returncode}: {' '.join(run.argv)}\n"
                           f"{result.stderr[-2000:]}")
    return result.metrics(), sampler


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
