"""AdamW and the learning-rate schedule.

Invariant: the optimiser update of step `t` depends only on the committed state and `t`: the
learning rate is a pure function `lr_at(t, cfg)` (no scheduler object with hidden counters to save
and restore), and the parameter groups are built in the model's fixed parameter order, so every
replica and every resumed run applies bitwise the same update to the same reduced gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from recover.app.config import RunConfig


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices/embeddings (dim >= 2) only, not on biases or norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused=False: the fused kernel is a separate implementation whose rounding may differ from
    # the reference path; foreach is left to torch (single-tensor on CPU, foreach on CUDA), both of
    # which are deterministic elementwise code, so same device + same inputs = same update.
    o = cfg.optim
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(o.beta1, o.beta2), eps=1e-8,
                             fused=False)


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of 0-based iteration `step`.

    Linear warmup lr/W, 2lr/W, ..., lr over the first W = warmup_steps iterations, then a cosine
    from lr (at step W) down to min_lr (reached at step == cfg.run.steps, and held after it).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    o = cfg.optim
    w = o.warmup_steps
    if step < w:
        return o.lr * (step + 1) / w
    progress = min(1.0, (step - w) / max(1, cfg.run.steps - w))
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - o.min_lr)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in opt.param_groups:
        group["lr"] = lr
