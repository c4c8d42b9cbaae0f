"""Where a failure-free recover step spends its time (used by `bench/overhead.py --profile`).

Runs the unmodified `recover.train.worker` in R processes against a real coordinator, after
wrapping (in each worker process only, never in the library's files) the step engine's phases,
the communicator's reduce and the worker's store client, which counts round-trips per phase.
Phases nest: run > {compute, chain, reduce > allreduce, decide, speed}; "loop" is the worker's
code outside `engine.run` (lr, zero, clip, optimizer step, step record into the store).

    python bench/_profile.py --run-dir D --replica r --coordinator host:port   (one worker)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from _common import BENCH_DIR, cpu_seconds, end, say

STORE_OPS = {"get", "set", "check", "add", "compare_set", "wait", "multi_get", "multi_set",
             "delete_key"}


class Prof:
    def __init__(self) -> None:
        self.stack = ["setup"]
        self.steps: list[dict] = []
        self.cur: dict = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        self.stack.append(name)
        t = time.perf_counter()
        try:
            yield
        finally:
            self.cur[name] += time.perf_counter() - t
            self.stack.pop()

    def store_op(self, dt: float) -> None:
        self.cur[f"rtt:{self.stack[-1]}"] += 1
        self.cur[f"store_s:{self.stack[-1]}"] += dt


class CountingStore:
    """Forwards to a real TCPStore; times and counts each call. clone() returns a real client."""

    def __init__(self, real, prof: Prof) -> None:
        self._real, self._prof = real, prof

    def __getattr__(self, name: str):
        attr = getattr(self._real, name)
        if name not in STORE_OPS:
            return attr

        def call(*a, **k):
            t = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self._prof.store_op(time.perf_counter() - t)
        return call


def install(prof: Prof) -> None:
    import recover.collectives.comm as comm
    import recover.collectives.keys as keys
    import recover.recovery.step as step

    connect = keys.connect_store
    keys.connect_store = lambda *a, **k: CountingStore(connect(*a, **k), prof)

    def timed(cls, meth: str, name: str) -> None:
        orig = getattr(cls, meth)

        def wrapper(self, *a, **k):
            with prof.phase(name):
                return orig(self, *a, **k)
        setattr(cls, meth, wrapper)

    for meth, name in (("_sync_chain", "chain"), ("_reduce", "reduce"), ("_decide", "decide"),
                       ("_record_speed", "speed")):
        timed(step.StepEngine, meth, name)
    timed(comm.FaultTolerantComm, "reduce", "allreduce")
    run = step.StepEngine.run

    def run_wrapper(self, t, compute):
        def timed_compute(i, j):
            with prof.phase("compute"):
                return compute(i, j)
        if prof.steps:
            prof.cur["loop"] = time.time() - prof.cur["t_end"]  # previous step's tail
        prof.cur = defaultdict(float)
        prof.steps.append(prof.cur)
        prof.cur["t_start"] = time.time()
        prof.cur["cpu_start"] = time.process_time()  # all threads: heartbeat, gloo, ...
        prof.stack = ["run"]
        with prof.phase("run"):
            res = run(self, t, timed_compute)
        prof.cur["t_end"] = time.time()
        prof.stack = ["loop"]
        return res
    step.StepEngine.run = run_wrapper


def profiled_run(cfg, timeout_s: float) -> tuple[list[list[dict]], list[tuple[float, float]]]:
    """Run cfg (a RunConfig) with profiled workers.

    Returns (each replica's per-step records, [(time, coordinator CPU seconds)] samples).
    """
    from recover.train.launch import prepare_run

    cfg, _ = prepare_run(cfg)
    out = Path(cfg.out)
    port_file = out / "coordinator.port"
    procs: list[subprocess.Popen] = []
    samples: list[tuple[float, float]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        coord = subprocess.Popen(
            [sys.executable, "-m", "recover.collectives.coordinator", "--replicas",
             str(cfg.replicas), "--port", "0", "--port-file", str(port_file), "--stale-s",
             str(cfg.stale_s), "--log", str(out / "coordinator.jsonl")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(coord)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        workers = []
        for r in range(cfg.replicas):
            log = open(out / "logs" / f"replica{r}.log", "ab")
            workers.append(subprocess.Popen(
                [sys.executable, str(BENCH_DIR / "_profile.py"), "--run-dir", str(out),
                 "--replica", str(r), "--coordinator", f"127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, env=env))
            procs.append(workers[-1])
        deadline = time.monotonic() + timeout_s
        while any(w.poll() is None for w in workers):  # sample the coordinator's CPU clock
            if time.monotonic() > deadline:
                raise RuntimeError(f"profiled run exceeded {timeout_s:.0f}s; see {out}/logs")
            samples.append((time.time(), cpu_seconds(coord.pid)))
            time.sleep(0.2)
        if any(w.returncode != 0 for w in workers):
            raise RuntimeError(f"profiled workers exited {[w.returncode for w in workers]}; "
                               f"see {out / 'logs'}")
    finally:
        end(procs[1:])
        end(procs[:1])
    reps = [json.loads((out / "prof" / f"replica{r}.json").read_text())
            for r in range(cfg.replicas)]
    for steps in reps:
        for a, b in zip(steps, steps[1:], strict=False):
            a["cpu"] = b["cpu_start"] - a["cpu_start"]
    return reps, samples


def worker_main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--replica", type=int, required=True)
    args, _ = ap.parse_known_args()
    prof = Prof()
    install(prof)
    from recover.train import worker

    code = worker.main(sys.argv[1:])
    if prof.cur.get("t_end"):
        prof.cur["loop"] = time.time() - prof.cur["t_end"]  # includes the final eval/ckpt
    d = Path(args.run_dir) / "prof"
    d.mkdir(exist_ok=True)
    (d / f"replica{args.replica}.json").write_text(json.dumps(prof.steps))
    say(f"profile written to {d}")
    return code


if __name__ == "__main__":
    code = worker_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
