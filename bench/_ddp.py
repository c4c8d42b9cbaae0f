"""Plain-DDP baseline worker for `bench/overhead.py`: one rank of R, no fault tolerance.

Same model (`build_model`), optimizer (`build_optimizer`, `lr_at`), data (`load_data`,
`microbatch`), microbatch ids (`plan(step, N, range(R))` with no speeds: N/R contiguous ids each,
what recover plans for equal speeds) and clipping as `recover.train.worker`; gradient accumulation
with `no_sync` on all but the last microbatch, whose backward runs DDP's bucketed allreduce. The
loss is scaled by R/N because DDP averages over R ranks, so the applied gradient is the same
(1/N) * sum of per-microbatch gradients. Rank r writes its timings to `--result`.

    python bench/_ddp.py --run-dir D --rank r --world R --store-file F --result J
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from recover.config import RunConfig
from recover.train.data import load_data, microbatch
from recover.train.model import build_model
from recover.train.optim import build_optimizer, lr_at, set_lr
from recover.workload import plan


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
    run_dir = Path(args.run_dir)
    cfg = RunConfig.load(run_dir / "config.json")
    corpus = load_data(run_dir / "data")
    m, n, world = cfg.model, cfg.microbatches, args.world
    store = dist.FileStore(args.store_file, world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    model = build_model(m, cfg.seed)
    opt = build_optimizer(model, cfg)
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb)
    params = [p for p in model.parameters() if p.requires_grad]
    rec: dict[str, list[float]] = {"end": [], "step_s": [], "accum_s": [], "last_s": [],
                                   "opt_s": [], "cpu": []}
    dist.barrier()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        set_lr(opt, lr_at(step, cfg))
        model.train()
        opt.zero_grad(set_to_none=False)
        ids = plan(step, n, list(range(world)))[args.rank]
        t_last = t0
        for j, i in enumerate(ids):
            if j == len(ids) - 1:
                t_last = time.perf_counter()
            x, y = microbatch(corpus.train, m.block_size, cfg.microbatch_size, cfg.seed, i)
            sync = j == len(ids) - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                _, loss = ddp(x, y)
                (loss * (world / n)).backward()  # DDP divides by R: net (1/N) * sum
            float(loss.detach())
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        t2 = time.perf_counter()
        rec["end"].append(time.time())
        rec["cpu"].append(time.process_time())  # this process's CPU seconds, all threads
        rec["step_s"].append(t2 - t0)
        rec["accum_s"].append(t_last - t0)
        rec["last_s"].append(t1 - t_last)
        rec["opt_s"].append(t2 - t1)
    dist.barrier()
    Path(args.result).write_text(json.dumps(rec))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
