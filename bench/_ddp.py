"""Plain-DDP baseline for `bench/overhead.py`: one rank of R, no fault tolerance.

Same model (`build_model`), optimizer (`build_optimizer`, `lr_at`), data (`load_data`,
`microbatch`), microbatch ids (`plan(step, N, range(R))` with no speeds: N/R contiguous ids each,
what recover plans for equal speeds) and clipping as `recover.app.train.worker`; gradient
accumulation with `no_sync` on all but the last microbatch, whose backward runs DDP's bucketed
allreduce. The loss is scaled by R/N because DDP averages over R ranks, so the applied gradient
is the same (1/N) * sum of per-microbatch gradients. `DDPTrainer` is also driven,
interleaved with recover's steps in the same processes, by `bench/_profile.py`. Standalone
(rank r writes `--result`):

    python bench/_ddp.py --run-dir D --rank r --world R --store-file F --result J
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from recover.app import rundir
from recover.app.config import RunConfig
from recover.app.train.data import load_data, microbatch
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer, lr_at, set_lr
from recover.procs import exit_after
from recover.workload import plan

KEYS = ("end", "step_s", "accum_s", "last_s", "opt_s", "cpu", "cpu_accum", "cpu_last", "cpu_opt")


class DDPTrainer:
    """One rank's DDP training loop on the default process group (initialised by the caller)."""

    def __init__(self, run_dir: Path, rank: int, world: int, bucket_mb: float = 25.0) -> None:
        self.cfg = RunConfig.load(run_dir / rundir.CONFIG)
        self.corpus = load_data(run_dir / rundir.DATA)
        self.rank, self.world = rank, world
        self.model = build_model(self.cfg.model, self.cfg.run.seed)
        self.opt = build_optimizer(self.model, self.cfg)
        self.ddp = DDP(self.model, gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.rec: dict = {k: [] for k in KEYS}
        self.rec["quota"] = max(len(v) for v in plan(0, self.cfg.data.microbatches,
                                                     list(range(world))).values())

    def step(self, step: int) -> None:
        cfg, m, n = self.cfg, self.cfg.model, self.cfg.data.microbatches
        t0, c0 = time.perf_counter(), time.thread_time()
        set_lr(self.opt, lr_at(step, cfg))
        self.model.train()
        self.opt.zero_grad(set_to_none=False)
        ids = plan(step, n, list(range(self.world)))[self.rank]
        t_last, c_last = t0, c0
        for j, i in enumerate(ids):
            sync = j == len(ids) - 1
            if sync:
                t_last, c_last = time.perf_counter(), time.thread_time()
            x, y = microbatch(self.corpus.train, m.block_size, cfg.data.microbatch_size,
                              cfg.run.seed, i, cfg.data.sampling)
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                _, loss = self.ddp(x, y)
                (loss * (self.world / n)).backward()  # DDP divides by R: net (1/N) * sum
            float(loss.detach())
        t1, c1 = time.perf_counter(), time.thread_time()
        torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip)
        self.opt.step()
        t2, c2 = time.perf_counter(), time.thread_time()
        for k, v in (("end", time.time()), ("cpu", time.process_time()), ("step_s", t2 - t0),
                     ("accum_s", t_last - t0), ("last_s", t1 - t_last), ("opt_s", t2 - t1),
                     ("cpu_accum", c_last - c0), ("cpu_last", c1 - c_last),
                     ("cpu_opt", c2 - c1)):
            self.rec[k].append(v)  # cpu: this process's CPU clock (all threads) at the end


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store-file", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = dist.FileStore(args.store_file, args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    trainer = DDPTrainer(Path(args.run_dir), args.rank, args.world, args.bucket_mb)
    dist.barrier()
    for step in range(trainer.cfg.run.steps):
        trainer.step(step)
    dist.barrier()
    Path(args.result).write_text(json.dumps(trainer.rec))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_after(main)
