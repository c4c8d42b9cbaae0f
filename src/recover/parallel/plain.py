"""The plain replica layout: one process holds the whole model.

Invariant: every parameter's `.grad` is a view into one flat buffer, so backward accumulates the
replica's local gradient directly into the buffer the cross-replica reduction reads (no copy per
microbatch, as DDP's gradient-as-bucket-view), and writing the reduced sum into the buffer updates
every `.grad` at once. If anything replaced the views (a user's `zero_grad()`, a checkpoint load),
`FlatGrads.zero()` lays them out again before the step's first microbatch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def flat_grad_buffer(model: nn.Module) -> torch.Tensor:
    """Allocate one zeroed buffer and make every trainable parameter's grad a view into it."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = params[0].dtype
    if any(p.dtype != dtype for p in params):
        raise ValueError("all trainable parameters must share one dtype")
    flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


class FlatGrads:
    """The plain layout's `GradAccess`: zero-copy both ways through one flat buffer."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.flat = flat_grad_buffer(module)
        self.numel, self.dtype, self.device = self.flat.numel(), self.flat.dtype, self.flat.device
        # `on_final`: autograd tells when a parameter's gradient is accumulated (once per
        # backward); the step engine reduces finished buckets while the backward goes on.
        self._ready: Callable[[int], None] | None = None
        for k, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(self._hook(k))

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if self._ready is not None:
                self._ready(k)
        return hook

    def on_final(self, ready: Callable[[int], None] | None) -> None:
        """Call `ready(k)` each time parameter k's gradient has been accumulated (None: stop)."""
        self._ready = ready

    def pack(self, into: torch.Tensor) -> None:
        into.copy_(self.flat)

    def assign(self, reduced: torch.Tensor) -> None:
        self.flat.copy_(reduced)

    @property
    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]

    def parts(self) -> list[torch.Tensor | None]:
        """Each parameter's gradient (a view of the flat buffer), in pack order."""
        return [p.grad for p in self.params]

    def local_flat(self) -> torch.Tensor:
        """The buffer every gradient views (exact mode folds and clears it in place)."""
        return self.flat

    def zero(self) -> None:
        self.flat.zero_()
        lo, hi = self.flat.data_ptr(), self.flat.data_ptr() + self.flat.nbytes
        if any(p.grad is None or not lo <= p.grad.data_ptr() < hi for p in self.params):
            self.flat = flat_grad_buffer(self.module)
