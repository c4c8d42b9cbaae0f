"""The run's model laid out as one rank of a replica: plain, hsdp, tp, pp or tp,pp (a foreign
model, `--model hf:` or `module:`, plain or hsdp).

Invariant: whatever the layout, `forward_backward(x, y)` adds this rank's share of
grad(mean loss of microbatch (x, y)) / N to its parameters' gradients and returns this rank's view
of that loss (`recover.Replica` weighs the views into the microbatch loss), and
`evaluate(x, y)` does the forward only. The model never sees `torch.distributed`: its parallelize
plans (`recover.app.train.parallelize`, on `recover.layouts`' model-agnostic pieces) wrap it, and
only the ranks of one replica share its default group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from recover.app.config import RunConfig
from recover.app.train import foreign
from recover.settings import LaunchEnv


@dataclass
class RankModel:
    model: nn.Module  # the whole GPT (plain) or its FSDP2/TP-wrapped form; unused stages dropped
    module: nn.Module  # what this rank trains: the model, or its pipeline stage
    mesh: object | None = None  # the replica's DeviceMesh (None for plain)
    tied: list[nn.Parameter] = field(default_factory=list)  # pipeline: shared first/last weights
    # (x, y, before_backward) -> this rank's loss; `before_backward` is the fault-injection point
    forward_backward: Callable[[Tensor, Tensor, Callable[[], None]], float] = lambda x, y, h: 0.0
    evaluate: Callable[[Tensor, Tensor], float] = lambda x, y: 0.0


AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = {"fp32": torch.float32, **AMP}


def device_of(cfg: RunConfig, replica: int, rank: int) -> torch.device:
    """cpu, or one GPU per process (replicas sharing a host share its GPUs round-robin)."""
    if cfg.compute.device == "cpu":
        return torch.device("cpu")
    idx = (replica * cfg.layout.ranks_per_replica() + rank) % max(1, torch.cuda.device_count())
    return torch.device("cuda", idx)


Amp = Callable[[], contextlib.AbstractContextManager]


def autocast(cfg: RunConfig, device: torch.device) -> Amp:
    """The forward's precision: autocast to --dtype; parameters and optimiser stay fp32."""
    if cfg.compute.dtype == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=AMP[cfg.compute.dtype])


def build(cfg: RunConfig, host: str, port: int, replica: int, rank: int,
          token: str | None = None) -> RankModel:
    """This rank's model in the run's layout (multi-rank layouts: joins the replica's group,
    checked against the run's `token` first)."""
    device = device_of(cfg, replica, rank)
    model = foreign.build_lm(cfg.model, cfg.run.seed).to(device)
    n, amp, loss = cfg.data.microbatches, autocast(cfg, device), foreign.loss_fn(cfg.model)
    if cfg.layout.name == "plain":
        return _dense(model, n, None, lambda t: t.to(device), amp, loss)
    from recover.app.train import parallelize as plan  # DTensor/FSDP2: seconds to import
    from recover.layouts import init_replica_group, replica_mesh
    from recover.layouts.hsdp import local_rows

    lay = cfg.layout
    init_replica_group(host, port, replica, rank, lay.ranks_per_replica(), cfg.ft.reduce_timeout_s,
                       LaunchEnv.from_env().incarnation, token)
    mesh = replica_mesh(lay.name, lay.shards, lay.tp, lay.stages)
    parts = cfg.layout.name.split(",")
    if "tp" in parts:
        plan.tensor_parallel(model, mesh)
    if cfg.layout.name == "hsdp" and foreign.kind(cfg.model.name) == "gpt":
        plan.fully_shard_gpt(model, mesh)
    elif cfg.layout.name == "hsdp":
        plan.fully_shard_foreign(model, mesh)
    if "pp" not in parts:
        return _dense(model, n, mesh, lambda t: local_rows(t, mesh), amp, loss)
    pipe = plan.gpt_pipeline(model, mesh, n)

    def fb_pipe(x: Tensor, y: Tensor, before_backward: Callable[[], None]) -> float:
        pipe.module.on_backward = before_backward  # fires when the backward reaches this stage
        with amp():
            return pipe.forward_backward(x, y)

    return RankModel(model, pipe.module, mesh, pipe.module.tied(), fb_pipe, pipe.evaluate)


def _dense(model: nn.Module, n: int, mesh: object | None, rows: Callable[[Tensor], Tensor],
           amp: Amp, loss_of: foreign.Loss) -> RankModel:
    """plain, hsdp, tp: the whole model on each rank, on `rows` of each microbatch."""

    def fb(x: Tensor, y: Tensor, before_backward: Callable[[], None]) -> float:
        with amp():  # the forward in --dtype; backward follows autocast's recorded casts
            loss = loss_of(model, rows(x), rows(y))
        before_backward()
        (loss / n).backward()  # constant N, never the live replica count
        return float(loss.detach())

    def ev(x: Tensor, y: Tensor) -> float:
        with amp():
            return float(loss_of(model, rows(x), rows(y)))

    return RankModel(model, model, mesh, [], fb, ev)


@torch.no_grad()
def evaluate(rm: RankModel, batches: list[tuple[Tensor, Tensor]]) -> float:
    """Mean validation loss of this rank's view (weighted and summed over ranks by the caller)."""
    rm.module.eval()
    losses = [rm.evaluate(x, y) for x, y in batches]
    rm.module.train()
    return sum(losses) / len(losses)
