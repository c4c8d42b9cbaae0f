"""The reference GPT laid out as one rank of a replica: plain, hsdp, tp, pp or tp,pp.

Invariant: whatever the layout, `forward_backward(x, y)` adds this rank's share of
grad(mean loss of microbatch (x, y)) / N to its parameters' gradients and returns this rank's view
of that loss (`recover.parallel.Replica` weighs the views into the microbatch loss), and
`evaluate(x, y)` does the forward only. The model never sees `torch.distributed`: the layout
helpers of `recover.parallel` wrap it, and only the ranks of one replica share its default group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from recover.config import RunConfig
from recover.train.model import build_model


@dataclass
class RankModel:
    model: nn.Module  # the whole GPT (plain) or its FSDP2/TP-wrapped form; unused stages dropped
    module: nn.Module  # what this rank trains: the model, or its pipeline stage
    mesh: object | None = None  # the replica's DeviceMesh (None for plain)
    tied: list[nn.Parameter] = field(default_factory=list)  # pipeline: shared first/last weights
    # (x, y, before_backward) -> this rank's loss; `before_backward` is the fault-injection point
    forward_backward: Callable[[Tensor, Tensor, Callable[[], None]], float] = lambda x, y, h: 0.0
    evaluate: Callable[[Tensor, Tensor], float] = lambda x, y: 0.0


def build(cfg: RunConfig, host: str, port: int, replica: int, rank: int) -> RankModel:
    """This rank's model in the run's layout (multi-rank layouts: joins the replica's group)."""
    model = build_model(cfg.model, cfg.seed)
    n = cfg.microbatches
    if cfg.layout == "plain":
        return _dense(model, n, None, lambda t: t)
    from recover.parallel import init_replica_group, replica_mesh  # DTensor/FSDP2: seconds
    from recover.parallel.hsdp import local_rows, shard_model
    from recover.parallel.pp import Pipeline
    from recover.parallel.tp import parallelize

    init_replica_group(host, port, replica, rank, cfg.ranks_per_replica(), cfg.reduce_timeout_s)
    mesh = replica_mesh(cfg.layout, cfg.shards, cfg.tp, cfg.stages)
    parts = cfg.layout.split(",")
    if "tp" in parts:
        parallelize(model, mesh)
    if cfg.layout == "hsdp":
        shard_model(model, mesh)
    if "pp" not in parts:
        return _dense(model, n, mesh, lambda t: local_rows(t, mesh))
    pipe = Pipeline(model, mesh, n)

    def fb_pipe(x: Tensor, y: Tensor, before_backward: Callable[[], None]) -> float:
        pipe.module.on_backward = before_backward  # fires when the backward reaches this stage
        return pipe.forward_backward(x, y)

    return RankModel(model, pipe.module, mesh, pipe.module.tied(), fb_pipe, pipe.evaluate)


def _dense(model: nn.Module, n: int, mesh: object | None,
           rows: Callable[[Tensor], Tensor]) -> RankModel:
    """plain, hsdp, tp: the whole model on each rank, on `rows` of each microbatch."""

    def fb(x: Tensor, y: Tensor, before_backward: Callable[[], None]) -> float:
        _, loss = model(rows(x), rows(y))
        before_backward()
        (loss / n).backward()  # constant N, never the live replica count
        return float(loss.detach())

    def ev(x: Tensor, y: Tensor) -> float:
        return float(model(rows(x), rows(y))[1])

    return RankModel(model, model, mesh, [], fb, ev)


@torch.no_grad()
def evaluate(rm: RankModel, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean validation loss of this rank's view (weighted and summed over ranks by the caller)."""
    rm.module.eval()
    losses = [rm.evaluate(x, y) for x, y in batches]
    rm.module.train()
    return sum(losses) / len(losses)
