"""Pipeline parallelism inside a replica (torch.distributed.pipelining, GPipe schedule).

Invariant: stage s of S holds blocks [s*L/S, (s+1)*L/S); stage 0 also the embeddings, the last
stage the final LayerNorm and the output head. One microbatch id (B sequences) is one schedule
step, split into `chunks` equal pipeline chunks; the loss function is the chunk's mean
cross-entropy / (chunks * N), so the stage gradients accumulated over a step are exactly the
plain replica's grad(mean loss over the id's B sequences) / N, summed over the step's ids (the
schedule's own gradient scaling is off: it would rescale gradients accumulated over earlier ids).
The output head is tied to the token embedding: the first and last stage each hold a copy, each
gets part of the gradient, and `Replica` sums the two (reduced) parts before the optimizer, so
both copies take the same update and stay equal. Only the last stage knows the loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


def stage_blocks(n_layer: int, stages: int, stage: int) -> range:
    if not 1 <= stages <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {stages} stages")
    return range(stage * n_layer // stages, (stage + 1) * n_layer // stages)


class Stage(nn.Module):
    """One pipeline stage of a GPT (`recover.app.train.model.GPT`), sharing its submodules."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(model.blocks[i]
                                    for i in stage_blocks(len(model.blocks), stages, stage))
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.on_backward: Callable[[], None] | None = None  # fault injection: backward begins

    def tied(self) -> list[nn.Parameter]:
        """This stage's copy of the embedding / output-head weight (if it holds one)."""
        if self.first and self.last:
            return []  # one stage holds both: already one tensor
        if self.first:
            return [self.wte.weight]
        return [self.lm_head.weight] if self.last else []

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        if self.on_backward is not None and x.requires_grad:
            hook = self.on_backward
            x.register_hook(lambda g: (hook(), g)[1])
        return x


class Pipeline:
    """This rank's stage of a replica's pipeline and its GPipe schedule."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, microbatches: int,
                 chunks: int | None = None) -> None:
        pp_mesh = mesh["pp"] if mesh.ndim > 1 else mesh
        self.stages, self.stage_index = pp_mesh.size(), pp_mesh.get_local_rank()
        self.module = Stage(model, self.stage_index, self.stages)
        self.chunks = chunks or self.stages
        self.n = microbatches
        self.vocab = model.lm_head.out_features
        self.stage = PipelineStage(self.module, self.stage_index, self.stages, torch.device("cpu"),
                                   group=pp_mesh.get_group())
        self.schedule = ScheduleGPipe(self.stage, self.chunks, loss_fn=self._loss,
                                      scale_grads=False)

    def _loss(self, logits: Tensor, y: Tensor) -> Tensor:
        ce = F.cross_entropy(logits.reshape(-1, self.vocab), y.reshape(-1))
        return ce / (self.chunks * self.n)

    def _run(self, x: Tensor, y: Tensor, train: bool) -> float:
        if x.size(0) % self.chunks:
            raise ValueError(f"microbatch size {x.size(0)} is not divisible by {self.chunks} "
                             "pipeline chunks")
        losses: list[Tensor] = []
        args = (x,) if self.module.first else ()
        target = y if self.module.last else None
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False)
        if not self.module.last:
            return 0.0
        return float(sum(float(v.detach()) for v in losses) * self.n)  # mean CE over B sequences

    def forward_backward(self, x: Tensor, y: Tensor) -> float:
        """One microbatch id: gradients += grad(mean loss)/N; its loss on the last stage, else 0."""
        return self._run(x, y, True)

    @torch.no_grad()
    def evaluate(self, x: Tensor, y: Tensor) -> float:
        """Forward only; the mean loss on the last stage, else 0."""
        return self._run(x, y, False)
