"""recover on an FSDP2 training loop: each replica is an FSDP2 shard group (HSDP).

The model, data and loop are an ordinary FSDP2 program; the lines marked `# recover` are the
whole integration: 5 lines. Launch it as `examples/common.py` says (one `torchrun` per
replica, all pointed at one coordinator).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import STEPS, N, batch, report, start
from torch import nn
from torch.distributed.fsdp import fully_shard

from recover.parallel import Replica
from recover.parallel.hsdp import local_rows


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
        report(rep, step, res)


if __name__ == "__main__":
    main()
