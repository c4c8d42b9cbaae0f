"""Tensor parallelism inside a replica (Megatron-style, with DTensor Colwise/Rowwise plans).

Invariant: TP rank r of a replica holds attention heads [r*h/tp, (r+1)*h/tp) and the matching
column block of each MLP's hidden layer; everything else (embeddings, LayerNorms, the tied head,
row-parallel biases) is replicated, identical on every TP rank. Every TP rank runs the same B
sequences and computes the same loss, so the replica's gradient of each id is the plain one.

The model's attention fuses q, k and v into one `c_attn` Linear of 3C output rows (q rows, then k,
then v). ColwiseParallel gives rank r a contiguous block of rows, which would hand rank 0 all of q
and half of k. So before sharding, `c_attn`'s rows are permuted to [q_0 k_0 v_0 | q_1 k_1 v_1 | ..]
(x_r = rank r's heads of x); rank r's block then splits into its own q, k and v heads, which is
what the model's forward does with a local tensor. The permutation only relabels rows of one
weight (and its bias): the function computed, and every AdamW update, are unchanged.
`qkv_order(C, tp)` is the permutation; `unpermute_state_dict` undoes it on a full state dict.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


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


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
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
    """A full (gathered) state dict of a `parallelize`d model, in the plain model's row order."""
    inv = torch.argsort(qkv_order(n_embd, tp))
    return {k: (v[inv] if k.endswith(("attn.c_attn.weight", "attn.c_attn.bias")) else v)
            for k, v in sd.items()}
