"""Where a failure-free recover step spends its time, next to DDP (for `bench/overhead.py`).

Runs the unmodified `recover.train.worker` in R processes against a real coordinator, after
wrapping (in each worker process only, never in the library's files) the step engine's phases,
the communicator's reduce and the worker's store client, which counts round-trips per phase.
Phases nest: run > {compute, chain, reduce > allreduce, decide, speed}; "loop" is the worker's
code outside `engine.run` (lr, zero, clip, optimizer step, step record into the store). With
--ddp-block K, every K recover steps each process runs K plain-DDP steps (`_ddp.DDPTrainer`).

    python bench/_profile.py --run-dir D --replica r --coordinator host:port [--ddp-block K]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from _common import BENCH_DIR, cpu_seconds, end
from _ddp import DDPTrainer

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
        t, c = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.cur[name] += time.perf_counter() - t
            self.cur[f"cpu:{name}"] += time.thread_time() - c  # this (main) thread's CPU
            self.stack.pop()

    def close_step(self) -> None:
        """End the current step: its tail after engine.run (optimizer, record) and CPU clocks."""
        c = self.cur
        c["loop"] = time.time() - c["t_end"]
        c["cpu"] = time.process_time() - c["cpu_start"]
        c["cpu:main"] = time.thread_time() - c["main_start"]
        c["cpu:loop"] = c["cpu:main"] - c["cpu:run"]
        c["cpu:background"] = c["cpu"] - c["cpu:main"]

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
            cfg = json.loads((run_dir / "config.json").read_text())
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
    import recover.collectives.comm as comm
    import recover.collectives.keys as keys
    import recover.recovery.step as step

    connect = keys.connect_store
    keys.connect_store = lambda *a, **k: CountingStore(connect(*a, **k), prof)

    def timed(cls, meth: str, name: str) -> None:
        orig = getattr(cls, meth, None)
        if orig is None:
            print(f"bench profile: {cls.__name__}.{meth} is gone; not timed", file=sys.stderr)
            return

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
            prof.close_step()
        first = False
        if inter is not None and inter.due(t):
            inter.run_block()
            first = True
        prof.cur = defaultdict(float)
        prof.steps.append(prof.cur)
        prof.cur.update(first=float(first), t_start=time.time(),
                        cpu_start=time.process_time(),  # all threads: heartbeat, gloo, ...
                        main_start=time.thread_time())  # the training thread alone
        prof.stack = ["run"]
        with prof.phase("run"):
            res = run(self, t, timed_compute)
        prof.cur["t_end"] = time.time()
        prof.cur["max_quota"] = float(max(res.quotas.values()))  # the step waits for this one
        prof.stack = ["loop"]
        return res
    step.StepEngine.run = run_wrapper


def profiled_run(cfg, timeout_s: float, ddp_block: int = 0, bucket_mb: float = 25.0,
                 patched: bool = False) -> tuple[list[dict], list[tuple[float, float]]]:
    """Run cfg (a RunConfig) with profiled workers (and DDP blocks if ddp_block > 0).

    Returns (per replica {"recover": [step records], "ddp": DDP records or None},
    [(time, coordinator CPU seconds)] samples).
    """
    from recover.train.launch import prepare_run

    cfg, _ = prepare_run(cfg)
    out = Path(cfg.run.out)
    port_file = out / "coordinator.port"
    procs: list[subprocess.Popen] = []
    samples: list[tuple[float, float]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        exe = ([str(BENCH_DIR / "_patches.py"), "coordinator"] if patched
               else ["-m", "recover.collectives.coordinator"])
        coord = subprocess.Popen(
            [sys.executable, *exe, "--replicas",
             str(cfg.layout.replicas), "--port", "0", "--port-file", str(port_file),
             "--stale-s", str(cfg.ft.stale_s), "--log", str(out / "coordinator.jsonl")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(coord)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        workers = []
        for r in range(cfg.layout.replicas):
            log = open(out / "logs" / f"replica{r}.log", "ab")
            workers.append(subprocess.Popen(
                [sys.executable, str(BENCH_DIR / "_profile.py"), "--run-dir", str(out),
                 "--replica", str(r), "--coordinator", f"127.0.0.1:{port}", "--ddp-block",
                 str(ddp_block), "--bucket-mb", str(bucket_mb)] + (["--patched"] * patched),
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
    return ([json.loads((out / "prof" / f"replica{r}.json").read_text())
             for r in range(cfg.layout.replicas)], samples)


def worker_main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--ddp-block", type=int, default=0, help="DDP steps per block (0: none)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--patched", action="store_true", help="apply bench/_patches.py first")
    args = ap.parse_args()
    if args.patched:
        import _patches

        _patches.apply()
    prof = Prof()
    run_dir = Path(args.run_dir)
    inter = (Interleave(run_dir, args.replica, args.coordinator, args.ddp_block, args.bucket_mb)
             if args.ddp_block else None)
    install(prof, inter)
    from recover.train import worker

    code = worker.main(["--run-dir", args.run_dir, "--replica", str(args.replica),
                        "--coordinator", args.coordinator])
    d = run_dir / "prof"
    d.mkdir(exist_ok=True)
    ddp = ({**inter.trainer.rec, "first": inter.first}
           if inter is not None and inter.trainer is not None else None)
    (d / f"replica{args.replica}.json").write_text(json.dumps({"recover": prof.steps,
                                                              "ddp": ddp}))
    return code


if __name__ == "__main__":
    code = worker_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
