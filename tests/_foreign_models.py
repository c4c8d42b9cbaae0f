"""Model factories for `recover train --model module:function` (tests/test_foreign.py): a user's own
small causal LM, and factories that are wrong in each way recover must refuse in one line."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Layer(nn.Module):
    """Pre-norm causal self-attention and an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """ids [B, T] -> logits [B, T, vocab]; its decoder layers in `layers` (FSDP2's units)."""

    def __init__(self, vocab_size: int, block_size: int, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab_size, width), nn.Embedding(block_size, width)
        self.layers = nn.ModuleList(Layer(width, 4) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab_size, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tiny_lm(vocab_size: int, block_size: int) -> nn.Module:
    return TinyLM(vocab_size, block_size)


def not_a_module(vocab_size: int, block_size: int) -> int:
    return vocab_size


def no_keywords(n: int) -> nn.Module:
    return TinyLM(n, n)


class Flat(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 8)

    def forward(self, ids: Tensor) -> Tensor:
        return self.embed(ids).sum(-1)  # [B, T]: no vocabulary dimension


def flat_output(vocab_size: int, block_size: int) -> nn.Module:
    return Flat(vocab_size)


NOT_CALLABLE = 3
