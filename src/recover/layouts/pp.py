"""Pipeline parallelism inside a replica (torch.distributed.pipelining, GPipe schedule).

Invariant: one microbatch id (B sequences) is one schedule step, split into `chunks` equal
pipeline chunks; the loss function is the chunk's mean loss / (chunks * N), so the stage
gradients accumulated over a step are exactly the plain replica's grad(mean loss over the id's B
sequences) / N, summed over the step's ids (the schedule's own gradient scaling is off: it would
rescale gradients accumulated over earlier ids). Only the last stage knows the loss. How a model
splits into stages is the model's own plan (the reference GPT's: `recover.app.train.parallelize`);
`stage_blocks` is the even split of L layers into S stages such plans use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

Loss = Callable[[Tensor, Tensor], Tensor]


def stage_blocks(n_layer: int, stages: int, stage: int) -> range:
    """The layers stage `stage` of `stages` holds: [stage*L/S, (stage+1)*L/S)."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {stages} stages")
    return range(stage * n_layer // stages, (stage + 1) * n_layer // stages)


def token_cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    """The mean cross-entropy over every token of `logits` [..., vocab] against `y` [...]."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


class Pipeline:
    """This rank's stage of a replica's pipeline and its GPipe schedule.

    `module` is this rank's stage (its coordinate along the mesh's "pp" dimension); `loss` the
    mean loss of a chunk's outputs against its targets (default: token cross-entropy).
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh, microbatches: int,
                 chunks: int | None = None, loss: Loss = token_cross_entropy) -> None:
        pp_mesh = mesh["pp"] if mesh.ndim > 1 else mesh
        self.stages, self.stage_index = pp_mesh.size(), pp_mesh.get_local_rank()
        self.first, self.last = self.stage_index == 0, self.stage_index == self.stages - 1
        self.module = module
        self.chunks = chunks or self.stages
        self.n, self.loss = microbatches, loss
        self.stage = PipelineStage(self.module, self.stage_index, self.stages, torch.device("cpu"),
                                   group=pp_mesh.get_group())
        self.schedule = ScheduleGPipe(self.stage, self.chunks, loss_fn=self._loss,
                                      scale_grads=False)

    def _loss(self, out: Tensor, y: Tensor) -> Tensor:
        return self.loss(out, y) / (self.chunks * self.n)

    def _run(self, x: Tensor, y: Tensor, train: bool) -> float:
        if x.size(0) % self.chunks:
            raise ValueError(f"microbatch size {x.size(0)} is not divisible by {self.chunks} "
                             "pipeline chunks")
        losses: list[Tensor] = []
        args = (x,) if self.first else ()
        target = y if self.last else None
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False)
        if not self.last:
            return 0.0
        return float(sum(float(v.detach()) for v in losses) * self.n)  # mean loss over B rows

    def forward_backward(self, x: Tensor, y: Tensor) -> float:
        """One microbatch id: gradients += grad(mean loss)/N; its loss on the last stage, else 0."""
        return self._run(x, y, True)

    @torch.no_grad()
    def evaluate(self, x: Tensor, y: Tensor) -> float:
        """Forward only; the mean loss on the last stage, else 0."""
        return self._run(x, y, False)
