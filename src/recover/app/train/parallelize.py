"""The parallelize plans: how `recover.app.train.model.GPT` (or, FSDP2 only, a foreign model)
becomes a replica.

Invariant: a plan only relabels or partitions the model's parameters; the function every replica
computes, and every AdamW update, are those of the plain model. The model owns its plans (as in
torchtitan): `recover.layouts` holds only model-agnostic pieces (FSDP2 over a shard group, a
GPipe schedule over any stage module, the mesh), and this module names the GPT's submodules
(`blocks`, `attn.c_attn`, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`, `wte`, `lm_head`).

Tensor parallelism (Megatron-style): TP rank r holds attention heads [r*h/tp, (r+1)*h/tp) and the
matching column block of each MLP's hidden layer; everything else (embeddings, LayerNorms, the
tied head, row-parallel biases) is replicated. Every TP rank runs the same B sequences and
computes the same loss, so the replica's gradient of each id is the plain one. The attention
fuses q, k and v into one `c_attn` Linear of 3C output rows (q rows, then k, then v);
ColwiseParallel gives rank r a contiguous block of rows, which would hand rank 0 all of q and half
of k. So before sharding, `c_attn`'s rows are permuted to [q_0 k_0 v_0 | q_1 k_1 v_1 | ..] (x_r =
rank r's heads of x); rank r's block then splits into its own q, k and v heads, which is what the
model's forward does with a local tensor. `qkv_order(C, tp)` is the permutation;
`unpermute_state_dict` undoes it on a full state dict.

Pipeline parallelism: stage s of S holds blocks [s*L/S, (s+1)*L/S); stage 0 also the embeddings,
the last stage the final LayerNorm and the output head. The head is tied to the token embedding:
the first and last stage each hold a copy (`GPTStage.tied`), and `recover.Replica` sums their two
reduced gradient parts before the optimizer, so both copies take the same update and stay equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from recover.app.train.foreign import decoder_layers
from recover.layouts.hsdp import shard_model
from recover.layouts.pp import Pipeline, stage_blocks


def qkv_order(n_embd: int, tp: int) -> torch.Tensor:
    """Row permutation of a fused [q; k; v] projection so that TP rank r's block is its heads."""
    if n_embd % tp:
        raise ValueError(f"n_embd ({n_embd}) is not divisible by tp ({tp})")
    w = n_embd // tp
    return torch.cat([torch.arange(part * n_embd + r * w, part * n_embd + (r + 1) * w)
                      for r in range(tp) for part in range(3)])


def _permute_rows(lin: nn.Linear, order: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.copy_(lin.weight[order])
        if lin.bias is not None:
            lin.bias.copy_(lin.bias[order])


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard every block's attention and MLP over the mesh's "tp" dimension (in place)."""
    tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
    tp = tp_mesh.size()
    for block in model.blocks:
        n_head = block.attn.c_attn.out_features // 3 // block.attn.head_dim
        if n_head % tp:
            raise ValueError(f"n_head ({n_head}) is not divisible by tp ({tp})")
        _permute_rows(block.attn.c_attn, qkv_order(block.attn.c_attn.in_features, tp))
        parallelize_module(block, tp_mesh, {
            "attn.c_attn": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        })
    return model


def unpermute_state_dict(sd: dict[str, torch.Tensor], n_embd: int, tp: int
                         ) -> dict[str, torch.Tensor]:
    """A full (gathered) state dict of a `tensor_parallel` model, in the plain model's row order."""
    inv = torch.argsort(qkv_order(n_embd, tp))
    return {k: (v[inv] if k.endswith(("attn.c_attn.weight", "attn.c_attn.bias")) else v)
            for k, v in sd.items()}


def fully_shard_gpt(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over the replica's shard group: one parameter group per transformer block."""
    return shard_model(model, mesh, model.blocks)


def fully_shard_foreign(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 of a foreign model (`--model hf:` or `module:`): one parameter group per decoder
    layer `foreign.decoder_layers` finds (e.g. a Llama's `model.layers`), else the whole model is
    one. A foreign model has no tp or pp plan: those name the GPT's submodules."""
    return shard_model(model, mesh, decoder_layers(model))


class GPTStage(nn.Module):
    """One pipeline stage of a GPT, sharing its submodules."""

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


def gpt_pipeline(model: nn.Module, mesh: DeviceMesh, microbatches: int) -> Pipeline:
    """This rank's stage of the GPT (by its "pp" coordinate) in a GPipe schedule."""
    pp_mesh = mesh["pp"] if mesh.ndim > 1 else mesh
    stage = GPTStage(model, pp_mesh.get_local_rank(), pp_mesh.size())
    return Pipeline(stage, mesh, microbatches)
