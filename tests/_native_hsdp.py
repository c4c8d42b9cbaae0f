"""torch's own HSDP, for test_layouts: FSDP2 on init_device_mesh(("replicate", "shard")).

Run with `torchrun --nproc-per-node R*K _native_hsdp.py RUN_DIR OUT_JSON`, or as `main([RUN_DIR,
OUT_JSON])` in R*K processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), as test_layouts forks them; RUN_DIR is a `recover train --layout hsdp` run (its
config.json and prepared data are reused). No recover
collective or recovery code is involved: replica r computes ids r*N/R .. (r+1)*N/R - 1 of each step
(its shard rank s takes rows [s*B/K, (s+1)*B/K) of each), and FSDP2 does the whole reduction.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from recover.app import rundir
from recover.app.config import RunConfig
from recover.app.train.data import load_data, microbatch
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer, lr_at, set_lr
from recover.procs import exit_after


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, out = Path(argv[0]), Path(argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = RunConfig.load(run_dir / rundir.CONFIG)
    n, b = cfg.data.microbatches, cfg.data.microbatch_size
    reps, k = cfg.layout.replicas, cfg.layout.shards
    corpus = load_data(run_dir / rundir.DATA)
    mesh = init_device_mesh("cpu", (reps, k), mesh_dim_names=("replicate", "shard"))
    model = build_model(cfg.model, cfg.run.seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, cfg)
    r, s = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    per, rows = n // reps, b // k
    losses = []
    for step in range(cfg.run.steps):
        set_lr(opt, lr_at(step, cfg))
        local = torch.zeros((), dtype=torch.float64)
        for i in range(step * n + r * per, step * n + (r + 1) * per):
            x, y = microbatch(corpus.train, cfg.model.block_size, b, cfg.run.seed, i,
                              cfg.data.sampling)
            _, loss = model(x[s * rows:(s + 1) * rows], y[s * rows:(s + 1) * rows])
            # FSDP2 averages over all R*K ranks: scaling by R/N makes it (1/N) sum_i grad(loss_i).
            (loss / per).backward()
            local += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(local)
        losses.append(float(local) / (n * k))
    if dist.get_rank() == 0:
        out.write_text(json.dumps(losses))
    dist.barrier()
    return 0


if __name__ == "__main__":
    exit_after(main)
