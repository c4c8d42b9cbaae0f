"""Local gradients of a rank whose parameters may be DTensors (FSDP2 shards, TP shards, PP stages).

Invariant: `pack(into)` writes the concatenation, in the fixed order of `params`, of each
parameter's *local* gradient (`p.grad.to_local()` for a DTensor, `p.grad` otherwise; zeros where a
gradient is still None), so two ranks at the same position of two replicas with the same layout
lay their gradients out identically and a cross-replica sum of what they pack is the sum of their
gradients.
`assign(flat)` writes such a vector back, creating gradients where they are None. Nothing else is
touched: the parameters, their sharding and FSDP2's own state are the layout's business.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor, without importing DTensor (a slow import): none can exist
    before its module is imported, and a plain replica never imports it."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (the local shard of a DTensor, else `t` itself)."""
    return t.to_local() if is_dtensor(t) else t


class ShardedGrads:
    """A `GradAccess` over the local shards of `params` (copies; FSDP2 owns its grad tensors)."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters on this rank")
        self.shapes = [local_tensor(p).shape for p in self.params]
        self.dtype = local_tensor(self.params[0]).dtype
        if any(local_tensor(p).dtype != self.dtype for p in self.params):
            raise ValueError("all trainable parameters must share one dtype")
        self.numel = sum(s.numel() for s in self.shapes)
        self.device = local_tensor(self.params[0]).device

    def pack(self, into: torch.Tensor) -> None:
        """Copy every local gradient into its slice of `into` (no other buffer is made)."""
        offset = 0
        with torch.no_grad():
            for p, s in zip(self.params, self.shapes, strict=True):
                part = into[offset: offset + s.numel()]
                if p.grad is None:
                    part.zero_()
                else:
                    part.copy_(local_tensor(p.grad).reshape(-1))
                offset += s.numel()

    def assign(self, reduced: torch.Tensor) -> None:
        if reduced.numel() != self.numel:
            raise ValueError(f"reduced gradient has {reduced.numel()} elements, expected "
                             f"{self.numel}")
        offset = 0
        with torch.no_grad():
            for p, s in zip(self.params, self.shapes, strict=True):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local_tensor(p.grad).copy_(reduced[offset: offset + s.numel()].view(s))
                offset += s.numel()

    @property
    def sizes(self) -> list[int]:
        return [s.numel() for s in self.shapes]

    def parts(self) -> list[torch.Tensor | None]:
        """Each parameter's local gradient (None where it has none yet), in pack order."""
        return [None if p.grad is None else local_tensor(p.grad) for p in self.params]

    def local_flat(self) -> None:
        """None: the local gradients are separate tensors (FSDP2 owns them), no one buffer."""
        return None

    def zero(self) -> None:
        """Start a step: no gradient (autograd / FSDP2 create them on first accumulation)."""
        for p in self.params:
            p.grad = None
