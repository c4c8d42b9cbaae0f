"""recover on a pipeline-parallel training loop: each replica is a pipeline (one stage per rank).

An ordinary `torch.distributed.pipelining` program (GPipe); the lines marked `# recover` are the
whole integration: 5 lines. Launch it as `examples/common.py` says (one `torchrun` per
replica, all pointed at one coordinator).

One microbatch id is one schedule step (split into CHUNKS pipeline chunks). Gradients accumulate
over the step's ids, so the schedule must not rescale them (`scale_grads=False`); the loss function
carries the 1/(CHUNKS * N) instead. Only the last stage sees the loss; `Replica` weights it so
`res.loss` is the step's mean loss on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import STEPS, N, batch, report, start
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from recover.replica import Replica

CHUNKS = 2  # pipeline chunks per microbatch


def main() -> None:
    mesh = start("pp")
    stages, me = dist.get_world_size(), dist.get_rank()
    layers = [nn.Sequential(nn.Linear(32, 128), nn.GELU()) for _ in range(stages - 1)]
    layers.append(nn.Sequential(nn.Linear(128 if stages > 1 else 32, 32)))
    stage_mod = layers[me]  # every rank builds the whole model, keeps its stage
    stage = PipelineStage(stage_mod, me, stages, torch.device("cpu"))
    last = me == stages - 1
    schedule = ScheduleGPipe(stage, CHUNKS, scale_grads=False,
                             loss_fn=lambda out, y: F.mse_loss(out, y) / (CHUNKS * N))
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=3e-3)

    rep = Replica(stage_mod, N, mesh=mesh)  # recover: join as this rank of $RECOVER_REPLICA
    for step in range(STEPS):
        def compute(mb_id: int, j: int) -> float:  # recover (was: for mb_id in step's N ids:)
            x, y = batch(mb_id)
            losses: list[torch.Tensor] = []
            schedule.step(*([x] if me == 0 else []), target=y if last else None, losses=losses)
            return sum(float(v.detach()) for v in losses) * N  # recover: the id's mean loss

        res = rep.step(step, compute)  # recover: my ids, fault-tolerant reduce, agreed commit
        rep.clip_grad_norm_(1.0)  # recover: (was a hand-written cross-stage norm)
        opt.step()
        opt.zero_grad()
        report(rep, step, res)


if __name__ == "__main__":
    main()
