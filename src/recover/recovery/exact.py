"""Exact mode: a step's gradient that is bitwise the same however its microbatches are grouped.

Each microbatch's gradient is folded, right after its backward, into a 64-bit fixed-point
accumulator: tensor k's elements become integers `round(g * 2^s_k)`. Integer addition is
associative, so the sum over the step's N microbatches, within a replica and then across replicas
(an int64 all-reduce), is the same integer in any order, on any grouping, after any fault. The
step's gradient is that integer times 2^-s_k, rounded once to the gradient's dtype; the loss is
summed the same way at a fixed scale.

Invariants:
- `s_k` is a pure function of the previous committed step's largest |g| of tensor k over all N
  microbatches (a max is grouping-independent; every replica reads the same maxima from the
  reduced trailer, one slot per replica), so every replica uses the same exponents.
- No sum can overflow: a microbatch whose |g| * 2^s_k reaches 2^62 / 2^ceil(log2 N) raises the
  step's overflow count (exactly: a comparison of powers of two); every replica sees the count in
  the reduced trailer, and the step is redone from scratch at exponents chosen from what was seen.
- Exponents start with 2^HEADROOM_BITS of headroom over the previous maximum, so an overflow
  needs a gradient 2^HEADROOM_BITS times larger than any of the previous step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

HEADROOM_BITS = 10  # a microbatch may be 1024x larger than the previous step's largest
LOSS_BITS = 32  # the loss is summed as round(loss * 2^32): exact to 2.3e-10
FIRST_MAX = 2.0**10  # the bound assumed before any step was seen


class ExactGrads:
    """A `GradAccess` over an int64 accumulator, around a layout's float gradients.

    `inner` is the layout's `GradAccess` that also gives `parts()`: its local gradient tensors in
    pack order (None where none exists yet). The trailer slots this adds per replica are
    [overflow count, max |g| of tensor 0, ..., of tensor T-1].
    """

    def __init__(self, inner: object, n: int) -> None:
        self.inner = inner
        self.sizes = [int(s) for s in inner.sizes]  # type: ignore[attr-defined]
        self.numel = sum(self.sizes) + 1  # + the loss
        self.dtype = torch.int64
        self.device = inner.device  # type: ignore[attr-defined]
        self.acc = torch.zeros(self.numel, dtype=torch.int64, device=self.device)
        # |q| < 2^62 / 2^ceil(log2 N), so the sum of N of them stays below 2^62.
        self.limit_bits = 62 - max(0, math.ceil(math.log2(n)))
        self.max_seen = [FIRST_MAX] * len(self.sizes)  # agreed maxima of the last step
        self.shifts = self._shifts(self.max_seen)
        self.local_max = [0.0] * len(self.sizes)
        self.overflow = 0
        self.loss = 0.0  # the committed step's loss sum (exact)

    # -- per microbatch ------------------------------------------------------------------------
    def fold(self, loss: float) -> None:
        """Add the microbatch just computed (its gradient sits in the layout's tensors) to the
        accumulator, exactly, and clear those tensors for the next one."""
        offset = 0
        parts = self.inner.parts()  # type: ignore[attr-defined]
        for k, (part, size) in enumerate(zip(parts, self.sizes, strict=True)):
            if part is not None:
                flat = part.reshape(-1)
                m = float(flat.abs().max()) if size else 0.0
                if not math.isfinite(m) or math.ldexp(m, self.shifts[k]) >= 2.0**self.limit_bits:
                    self.overflow += 1
                self.local_max[k] = max(self.local_max[k], m if math.isfinite(m) else math.inf)
                # g * 2^s is exact in g's own dtype (a power of two), its round too, and so is
                # the integer-valued result's conversion to int64: no float64 copy is needed.
                q = flat.mul(2.0 ** self.shifts[k]).round_().nan_to_num_(0.0, 0.0, 0.0)
                self.acc[offset: offset + size] += q.to(torch.int64)
                del q
                part.zero_()
            offset += size
        q_loss = math.ldexp(loss, LOSS_BITS) if math.isfinite(loss) else math.inf
        if abs(q_loss) >= 2.0**self.limit_bits:
            self.overflow += 1
        else:
            self.acc[-1] += round(q_loss)

    # -- GradAccess ----------------------------------------------------------------------------
    def pack(self, into: torch.Tensor) -> None:
        into.copy_(self.acc)

    def assign(self, reduced: torch.Tensor) -> None:
        self.loss = math.ldexp(float(reduced[-1]), -LOSS_BITS)
        offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        # One tensor at a time (a generator): the integer rounded once to float32, then scaled
        # by a power of two (exact), never a float64 copy of the whole gradient.
        self.inner.assign_parts(  # type: ignore[attr-defined]
            reduced[o: o + n].to(torch.float32).mul_(2.0 ** -self.shifts[k])
            for k, (o, n) in enumerate(zip(offsets, self.sizes, strict=True)))

    def zero(self) -> None:
        self.acc.zero_()
        self.inner.zero()  # type: ignore[attr-defined]
        self.local_max = [0.0] * len(self.sizes)
        self.overflow = 0

    # -- trailer slots and exponents -----------------------------------------------------------
    @property
    def slots(self) -> int:
        return 1 + len(self.sizes)

    def slot_values(self) -> list[float]:
        return [float(self.overflow), *self.local_max]

    def agree(self, table: torch.Tensor) -> bool:
        """Read every replica's slots (rows of `table`) from the reduced trailer; set the next
        exponents; return whether the step overflowed anywhere (then it must be redone)."""
        overflowed = bool(table[:, 0].sum() > 0)
        seen = table[:, 1:].max(dim=0).values.tolist()
        if overflowed:  # widen every tensor the step reached past its bound, from what was seen
            self.max_seen = [max(a, b) for a, b in zip(self.max_seen, seen, strict=True)]
        else:
            self.max_seen = [v if v > 0 else a for v, a in zip(seen, self.max_seen, strict=True)]
        self.max_seen = [v if math.isfinite(v) else 2.0**100 for v in self.max_seen]
        self.shifts = self._shifts(self.max_seen)
        return overflowed

    def set_maxima(self, maxima: Sequence[float]) -> None:
        """Adopt agreed maxima (a joiner's, from its donor): the exponents follow from them."""
        self.max_seen = [float(v) for v in maxima]
        self.shifts = self._shifts(self.max_seen)

    def _shifts(self, maxima: Sequence[float]) -> list[int]:
        """s_k: the largest shift that leaves HEADROOM_BITS of room over the maximum."""
        out = []
        for m in maxima:
            e = math.frexp(m)[1] if m > 0 else 0  # m < 2^e
            out.append(self.limit_bits - HEADROOM_BITS - e)
        return out
