"""Where a failure-free recover step spends its time, next to DDP (for `bench/overhead.py`).

Runs the unmodified `recover.app.train.worker` in R processes against a real coordinator. Invariant:
it reads only what the library makes public and patches no name starting with `_`: the phase
split comes from the cumulative counters `StepEngine.stats` ("compute_s", "reduce_s",
"decide_s", "store_ops", ...) and `FaultTolerantComm.stats` ("reduce_s", "build_s",
"barrier_s", ...), read before and after each `StepEngine.run` (the public step call, wrapped to
mark step boundaries); store round-trips are counted by a wrapper around the store clients that
the public `recover.control.keys.connect_store` returns. A counter the installed library
does not have yet is simply absent from the records (the report shows n/a), and a hook that no
longer takes is reported on stderr and in the records, never silently measured as zero.
With --ddp-block K, every K recover steps each process runs K plain-DDP steps
(`_ddp.DDPTrainer`) between recover's steps.

    python bench/_profile.py --run-dir D --replica r --coordinator host:port [--ddp-block K]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from _common import BENCH_DIR, cpu_seconds
from _ddp import DDPTrainer
from recover.app import rundir
from recover.procs import exit_after, start, stop, stop_all

log = logging.getLogger("bench.profile")

STORE_OPS = {"get", "set", "check", "add", "compare_set", "wait", "multi_get", "multi_set",
             "delete_key"}


def numbers(stats: Any) -> dict[str, float]:
    """A snapshot of a public stats mapping: its numeric entries only ({} when there is none)."""
    if not isinstance(stats, dict):
        return {}
    return {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}


class Prof:
    """Per-step records of one worker process; `where` is "setup", "run" or "loop"."""

    def __init__(self) -> None:
        self.where = "setup"
        self.steps: list[dict[str, float]] = []
        self.cur: dict[str, float] = defaultdict(float)
        self.store_clients = 0  # clients wrapped by the counting store

    def store_op(self, dt: float) -> None:
        self.cur[f"rtt:{self.where}"] += 1
        self.cur[f"store_s:{self.where}"] += dt

    def close_step(self) -> None:
        """End the current step: the tail after engine.run (optimizer, record) and CPU clocks."""
        c = self.cur
        c["loop"] = time.time() - c["t_end"]
        c["cpu"] = time.process_time() - c["cpu_start"]
        c["cpu:main"] = time.thread_time() - c["main_start"]
        c["cpu:loop"] = c["cpu:main"] - c["cpu:run"]
        c["cpu:background"] = c["cpu"] - c["cpu:main"]


class CountingStore:
    """Forwards to a real store client; times and counts each call. clone() returns a real client
    (the background threads' clients are not counted: only the training thread's round-trips)."""

    def __init__(self, real: Any, prof: Prof) -> None:
        self._real, self._prof = real, prof

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in STORE_OPS:
            return attr

        def call(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                self._prof.store_op(time.perf_counter() - t)
        return call


class Interleave:
    """Runs blocks of plain-DDP steps (`bench/_ddp.py`) in this process between recover's steps.

    Every replica enters a block before the same recover step, so DDP's collectives line up; its
    process group rendezvouses through the coordinator's store (prefix `bench-ddp`). Recover's
    background threads and the coordinator keep running during DDP's blocks (a small bias in
    DDP's disfavour, see the report).
    """

    def __init__(self, run_dir: Path, replica: int, coordinator: str, block: int,
                 bucket_mb: float) -> None:
        self.args = (run_dir, replica, coordinator, bucket_mb)
        self.block, self.trainer, self.next_step = block, None, 0
        self.first: list[int] = []  # indices of the first DDP step of each block

    def due(self, step: int) -> bool:
        return self.block > 0 and step > 0 and step % self.block == 0

    def run_block(self) -> None:
        if self.trainer is None:
            run_dir, replica, coordinator, bucket_mb = self.args
            host, port = coordinator.rsplit(":", 1)
            cfg = json.loads((run_dir / rundir.CONFIG).read_text())
            store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=120))
            dist.init_process_group("gloo", store=dist.PrefixStore("bench-ddp", store),
                                    rank=replica, world_size=cfg["layout"]["replicas"],
                                    timeout=datetime.timedelta(seconds=120))
            self.trainer = DDPTrainer(run_dir, replica, cfg["layout"]["replicas"], bucket_mb)
            dist.barrier()
        self.first.append(len(self.trainer.rec["end"]))
        for _ in range(self.block):
            self.trainer.step(self.next_step)
            self.next_step += 1


def install(prof: Prof, inter: Interleave | None = None) -> None:
    """Wrap the public store factory and `StepEngine.run` in this (worker) process only."""
    from recover.control import keys
    from recover.recovery import StepEngine

    connect = keys.connect_store

    def counting_connect(*a: Any, **k: Any) -> CountingStore:
        prof.store_clients += 1
        return CountingStore(connect(*a, **k), prof)
    keys.connect_store = counting_connect
    run: Callable[..., Any] = StepEngine.run

    def run_wrapper(self: Any, t: int, compute: Callable[[int, int], float], *rest: Any) -> Any:
        if prof.steps:
            prof.close_step()
        first = False
        if inter is not None and inter.due(t):
            inter.run_block()
            first = True
        engine0 = numbers(getattr(self, "stats", None))
        comm0 = numbers(getattr(getattr(self, "comm", None), "stats", None))
        prof.cur = defaultdict(float)
        prof.steps.append(prof.cur)
        prof.cur.update(first=float(first), t_start=time.time(),
                        cpu_start=time.process_time(),  # all threads: heartbeat, gloo, ...
                        main_start=time.thread_time())  # the training thread alone
        prof.where = "run"
        t0, c0 = time.perf_counter(), time.thread_time()
        res = run(self, t, compute, *rest)  # rest: exact mode's round
        prof.cur["run"] = time.perf_counter() - t0
        prof.cur["cpu:run"] = time.thread_time() - c0
        prof.cur["t_end"] = time.time()
        prof.where = "loop"
        for pre, before, now in (
                ("engine", engine0, numbers(getattr(self, "stats", None))),
                ("comm", comm0, numbers(getattr(getattr(self, "comm", None), "stats", None)))):
            for k, v in now.items():  # cumulative counters: this step's share is the difference
                prof.cur[f"{pre}:{k}"] = v - before.get(k, 0.0)
        prof.cur["max_quota"] = float(max(res.quotas.values()))  # the step waits for this one
        return res
    StepEngine.run = run_wrapper  # type: ignore[method-assign]


def profiled_run(cfg: Any, timeout_s: float, ddp_block: int = 0, bucket_mb: float = 25.0
                 ) -> tuple[list[dict], list[tuple[float, float]]]:
    """Run cfg (a RunConfig) with profiled workers (and DDP blocks if ddp_block > 0).

    Returns (per replica {"recover": [step records], "ddp": DDP records or None, "hooks": which
    hooks took}, [(time, coordinator CPU seconds)] samples).
    """
    from recover.app.train.prepared import prepare_run

    cfg = prepare_run(cfg).cfg
    out = Path(cfg.run.out)
    port_file = out / rundir.COORDINATOR_PORT
    samples: list[tuple[float, float]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    coord = start([sys.executable, "-m", "recover.control.coordinator", "--replicas",
                   str(cfg.layout.replicas), "--port", "0", "--port-file", str(port_file),
                   "--stale-s", str(cfg.ft.stale_s), "--log", str(out / rundir.COORDINATOR_LOG),
                   "--token-file", str(out / rundir.RUN_TOKEN)],  # the workers prove the run's
                  out / rundir.LOGS / rundir.COORDINATOR_OUT)
    workers = []
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        for r in range(cfg.layout.replicas):
            workers.append(start(
                [sys.executable, str(BENCH_DIR / "_profile.py"), "--run-dir", str(out),
                 "--replica", str(r), "--coordinator", f"127.0.0.1:{port}", "--ddp-block",
                 str(ddp_block), "--bucket-mb", str(bucket_mb)],
                out / rundir.LOGS / f"replica{r}.log", env=env))
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
        stop_all(workers)
        stop(coord)
    return ([json.loads((out / "prof" / f"replica{r}.json").read_text())
             for r in range(cfg.layout.replicas)], samples)


def worker_main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--ddp-block", type=int, default=0, help="DDP steps per block (0: none)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    args = ap.parse_args()
    prof = Prof()
    run_dir = Path(args.run_dir)
    inter = (Interleave(run_dir, args.replica, args.coordinator, args.ddp_block, args.bucket_mb)
             if args.ddp_block else None)
    install(prof, inter)
    from recover.app.train import worker

    code = worker.main(["--run-dir", args.run_dir, "--replica", str(args.replica),
                        "--coordinator", args.coordinator])
    if prof.steps:
        prof.close_step()  # the last step's tail (its record, the final checkpoint)
    hooks = {"steps": bool(prof.steps), "store": prof.store_clients > 0}
    for name, took in hooks.items():
        if not took:  # the library changed under the profiler: say so, never report zeros
            log.error("bench profile: the %s hook did not take (see bench/_profile.py)", name)
    d = run_dir / "prof"
    d.mkdir(exist_ok=True)
    ddp = ({**inter.trainer.rec, "first": inter.first}
           if inter is not None and inter.trainer is not None else None)
    (d / f"replica{args.replica}.json").write_text(json.dumps({"recover": prof.steps,
                                                              "ddp": ddp, "hooks": hooks}))
    return code


if __name__ == "__main__":
    exit_after(worker_main)
