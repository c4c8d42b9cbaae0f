"""recover on an FSDP2 training loop: each replica is an FSDP2 shard group (HSDP).

The model, data and loop are an ordinary FSDP2 program; the lines marked `# recover` are the
whole integration: 5 lines. One `torchrun` per replica, all pointed at one coordinator:

    recover coordinator --replicas 2 --port 29600 &
    for r in 0 1; do
      RECOVER_COORDINATOR=127.0.0.1:29600 RECOVER_REPLICA=$r \\
        torchrun --standalone --nproc-per-node 2 examples/hsdp.py &
    done; wait

Kill any one rank (`kill -9 PID`): its replica's other rank exits by itself (code 3), and the
other replica finishes the run with the same losses, recomputing the lost microbatches.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from recover.parallel import Replica
from recover.parallel.hsdp import local_rows

log = logging.getLogger("example")
N, B, STEPS = 8, 8, 30  # microbatches per step, sequences per microbatch, steps


def batch(mb_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch `mb_id`: a pure function of the id (whoever computes it gets the same data)."""
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(B, 32, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True)).expand(B, 32)


def main() -> None:
    # recover's own lines (joins, recoveries, fencing) come through the same handler.
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # this replica's ranks only (one torchrun per replica)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 32))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    rep = Replica(model, N, mesh=mesh)  # recover: join as this rank of replica $RECOVER_REPLICA
    for step in range(STEPS):
        def compute(mb_id: int, j: int) -> float:  # recover (was: for mb_id in step's N ids:)
            x, y = batch(mb_id)
            loss = F.mse_loss(model(local_rows(x, mesh)), local_rows(y, mesh))  # my shard's rows
            (loss / N).backward()
            return loss.item()  # recover

        res = rep.step(step, compute)  # recover: my ids, fault-tolerant reduce, agreed commit
        rep.clip_grad_norm_(1.0)  # recover: (was torch.nn.utils.clip_grad_norm_)
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            log.info(f"replica {rep.replica} step {step} loss {res.loss:.6f} "
                     f"live replicas {res.members}")


if __name__ == "__main__":
    main()
