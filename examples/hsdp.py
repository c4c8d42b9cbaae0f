"""recover on an FSDP2 training loop: each replica is an FSDP2 shard group (HSDP).

The model, data and loop are an ordinary FSDP2 program; the lines marked `# recover`, here and in
the loop every example shares (`common.train`), are the whole integration: 5 lines.
Launch it as `examples/common.py` says (one `torchrun` per replica, all pointed at one coordinator).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import N, start, train
from torch import nn
from torch.distributed.fsdp import fully_shard

from recover.replica import Replica


def main() -> None:
    mesh = start("shard")
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 32))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    rep = Replica(model, N, mesh=mesh)  # recover: join as this rank of replica $RECOVER_REPLICA
    # Each rank reads, and takes its loss over, its own shard's rows of the microbatch.
    train(rep, opt, lambda x, y: F.mse_loss(model(x), y), part=(mesh.get_local_rank(), mesh.size()))


if __name__ == "__main__":
    main()
