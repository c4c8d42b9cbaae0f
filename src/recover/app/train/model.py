"""A nanoGPT-style decoder-only transformer.

Invariant: a model is a pure function of `(ModelConfig, seed)`. `build_model` gives bitwise the same
parameters for the same seed and neither reads nor advances the global RNG, so building a model
anywhere (a replica joining late, a reference run) never shifts anyone's random draws. The forward
pass itself uses only the global RNG (through `nn.Dropout` and SDPA's dropout); the trainer makes it
deterministic by seeding that RNG per microbatch id. This module never imports the distributed
package: its parallelize plans (FSDP2, TP, PP: `recover.app.train.parallelize`) wrap it from
outside, relying on the stable submodule names below (`blocks`, `attn.c_attn`, `attn.c_proj`,
`mlp.c_fc`, `mlp.c_proj`, `wte`, `lm_head`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from recover.app.config import ModelConfig


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.c_attn(x)
        # Widths are read from the tensors rather than the config so that a tensor-parallel wrapper
        # that gives each rank a slice of the heads runs this same code on its local shard.
        q, k, v = qkv.split(qkv.size(-1) // 3, dim=2)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: 4x expansion with GELU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer with learned positions and a weight-tied output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Tying: one tensor serves as input embedding and output projection (fewer parameters,
        # and the usual nanoGPT/GPT-2 choice). `parameters()` yields it once.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scaling: each residual branch's output projection is shrunk by sqrt(2 * n_layer)
        # so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits `[B, T, vocab]` and, given targets, the mean cross-entropy over all B*T tokens."""
        _, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        # Mean over the microbatch's tokens: every microbatch has the same token count, so the
        # step's gradient (sum over ids / N) equals the mean over the step's tokens.
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """A freshly initialised GPT, bitwise identical for the same `(cfg, seed)`.

    The global CPU RNG is forked so construction neither depends on nor disturbs it (the trainer's
    dropout draws must not shift because a model was built). `devices=[]`: init runs on CPU, so
    there is no CUDA RNG to fork, and forking it would touch every GPU.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)


def num_params(model: nn.Module) -> int:
    """Number of distinct parameter elements (the tied embedding/head counts once)."""
    return sum(p.numel() for p in model.parameters())
