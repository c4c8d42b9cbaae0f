"""How the step engine reads and writes one rank's local gradient (`GradAccess`), and the
simplest access, one flat tensor (`TensorGrad`).

Invariant: `pack` never modifies the local gradient, so a failed attempt reduces it again.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class GradAccess(Protocol):
    """How the engine reads and writes one rank's local gradient (the layout decides how).

    The local gradient is never modified by `pack`: it is the kept copy a failed attempt
    reduces again."""

    numel: int
    dtype: torch.dtype
    device: torch.device

    def pack(self, into: torch.Tensor) -> None:
        """Write the local gradient, flattened in a fixed order, into `into` (numel elements)."""
        ...

    def assign(self, reduced: torch.Tensor) -> None:
        """Make the parameters' gradients equal to `reduced` (flat, the order of `pack`)."""
        ...

    def zero(self) -> None:
        """Forget the local gradient (start of a step, or an attempt a strategy discards)."""
        ...


class TensorGrad:
    """A `GradAccess` over one flat tensor that the caller accumulates into."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.numel, self.dtype, self.device = flat.numel(), flat.dtype, flat.device

    def pack(self, into: torch.Tensor) -> None:
        into.copy_(self.flat)

    def assign(self, reduced: torch.Tensor) -> None:
        self.flat.copy_(reduced)

    def zero(self) -> None:
        self.flat.zero_()
