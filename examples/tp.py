"""recover on a tensor-parallel training loop: each replica is a TP group.

An ordinary DTensor TP program (Colwise then Rowwise Linear); the lines marked `# recover`, here and
in the loop the examples share (`common.train`), are the whole integration: 5 lines.
Launch it as `examples/common.py` says (one `torchrun` per replica, all pointed at one coordinator).

Every TP rank runs the whole microbatch; `Replica` reduces each rank's local shards with the
same-ranked TP shard of every other replica, and counts replicated parameters once in the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import N, start, train
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from recover.replica import Replica


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)  # replicated on every TP rank
        self.up, self.down = nn.Linear(32, 256), nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


def main() -> None:
    mesh = start("tp")
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    rep = Replica(model, N, mesh=mesh)  # recover: join as this rank of replica $RECOVER_REPLICA
    train(rep, opt, lambda x, y: F.mse_loss(model(x), y))  # every TP rank: the whole microbatch


if __name__ == "__main__":
    main()
