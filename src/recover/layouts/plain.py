"""The plain replica layout: one process holds the whole model.

Invariant: every parameter's `.grad` is a view into one flat buffer, so backward accumulates the
replica's local gradient directly into the buffer the cross-replica reduction reads (no copy per
microbatch, as DDP's gradient-as-bucket-view), and writing the reduced sum into the buffer updates
every `.grad` at once. The views are laid out by `FlatGrads.zero()`, before each step's first
microbatch, over the same buffer whenever it still fits the parameters: never at construction, so
until the first step every `.grad` is as the caller left it (None after `zero_grad()`), which
`torch.distributed.checkpoint.state_dict.get_state_dict` needs to create a never-stepped
optimizer's state (it creates none where a parameter has a gradient: a resume into it would then
load no optimizer state at all).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def flat_grad_buffer(model: nn.Module, attach: bool = True) -> torch.Tensor:
    """Allocate one zeroed buffer for every trainable parameter's gradient (with `attach`, make
    each one's `.grad` a view into it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = params[0].dtype
    if any(p.dtype != dtype for p in params):
        raise ValueError("all trainable parameters must share one dtype")
    flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
    if attach:
        attach_grads(params, flat)
    return flat


def attach_grads(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Make each parameter's `.grad` its view of `flat`, in order."""
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()


class FlatGrads:
    """The plain layout's `GradAccess`: zero-copy both ways through one flat buffer."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.flat = flat_grad_buffer(module, attach=False)  # attached by the first `zero()`
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
            p0 = self.params[0]
            if (self.flat.dtype, self.flat.device) == (p0.dtype, p0.device):
                attach_grads(self.params, self.flat)  # the same buffer: what views it stays valid
            else:  # the module moved (`.to()`) since: a buffer where it is now
                self.flat = flat_grad_buffer(self.module)
