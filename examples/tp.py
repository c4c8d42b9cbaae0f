"""recover on a tensor-parallel training loop: each replica is a TP group.

An ordinary DTensor TP program (Colwise then Rowwise Linear); the lines marked `# recover` are the
whole integration: 5 lines. One `torchrun` per replica, all pointed at one coordinator:

    recover coordinator --replicas 2 --port 29600 &
    for r in 0 1; do
      RECOVER_COORDINATOR=127.0.0.1:29600 RECOVER_REPLICA=$r \\
        torchrun --standalone --nproc-per-node 2 examples/tp.py &
    done; wait

Every TP rank runs the whole microbatch; `Replica` reduces each rank's local shards with the
same-ranked TP shard of every other replica, and counts replicated parameters once in the norm.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from recover.parallel import Replica

log = logging.getLogger("example")
N, B, STEPS = 8, 8, 30


def batch(mb_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(B, 32, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True)).expand(B, 32)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)  # replicated on every TP rank
        self.up, self.down = nn.Linear(32, 256), nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


def main() -> None:
    # recover's own lines (joins, recoveries, fencing) come through the same handler.
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # this replica's ranks only (one torchrun per replica)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    rep = Replica(model, N, mesh=mesh)  # recover: join as this rank of replica $RECOVER_REPLICA
    for step in range(STEPS):
        def compute(mb_id: int, j: int) -> float:  # recover (was: for mb_id in step's N ids:)
            x, y = batch(mb_id)
            loss = F.mse_loss(model(x), y)
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
