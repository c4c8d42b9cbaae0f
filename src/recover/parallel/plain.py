"""The plain replica layout: one process holds the whole model.

Invariant: every parameter's `.grad` is a view into one flat buffer, so backward accumulates the
replica's local gradient directly into the buffer the cross-replica reduction reads (no copy per
microbatch, as DDP's gradient-as-bucket-view), and writing the reduced sum into the buffer updates
every `.grad` at once.
"""

from __future__ import annotations

import torch
from torch import nn


def flat_grad_buffer(model: nn.Module) -> torch.Tensor:
    """Allocate one zeroed buffer and make every trainable parameter's grad a view into it."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = params[0].dtype
    if any(p.dtype != dtype for p in params):
        raise ValueError("all trainable parameters must share one dtype")
    flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype)
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat
