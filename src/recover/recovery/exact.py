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
# Shifts stay where 2^s and 2^-s are both normal float32 numbers, so the per-element scale
# vector and its inverse are exact powers of two (only a tensor whose largest |g| is < 2^-74
# gets fewer than the usual bits).
MAX_SHIFT = 126
# Elements converted to int64 and summed per operation: a 512 KiB int64 scratch that stays in
# cache (the small preset's fold took 3.1 ms with it, 3.9 ms in 8 MiB chunks, 4.1 in 128 KiB).
CHUNK = 1 << 16


class ExactGrads:
    """A `GradAccess` over an int64 accumulator, around a layout's float gradients.

    `inner` is the layout's `GradAccess` that also gives `sizes`, `parts()` (its local gradient
    tensors in pack order, None where none exists yet) and `local_flat()` (the one buffer every
    local gradient is a view of, or None where there is none: then each microbatch is packed
    into a buffer of this class's first). The trailer slots this adds per replica are
    [overflow count, max |g| of tensor 0, ..., of tensor T-1].

    A fold is a fixed number of whole-buffer operations whatever the number of tensors, and no
    device-to-host copy: the per-tensor maxima in two `_foreach_max` calls, the overflow count
    and running maxima kept on the device (read once per step, by `slot_values`), the scaling
    by a per-element vector of 2^s_k, one round, the int64 conversion and sum in chunks.
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
        n_grad, dev = self.numel - 1, self.device
        self._scratch = torch.empty(min(n_grad, CHUNK), dtype=torch.int64, device=dev)
        self._own: torch.Tensor | None = None  # the packed microbatch, for a layout without one
        self._nonempty = [k for k, s in enumerate(self.sizes) if s]  # _foreach_max needs > 0
        self._split: tuple[int, list[torch.Tensor]] = (-1, [])  # (data_ptr, non-empty views)
        # Per-element -2^s_k, per-tensor 2^s_k (float64, for the overflow test) and the shifts
        # they hold: rebuilt only when the shifts change.
        self._scale = torch.empty(n_grad, dtype=torch.float32, device=dev)
        self._pow = torch.empty(len(self._nonempty), dtype=torch.float64, device=dev)
        self._scale_for: list[int] = []
        self._offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        # This step's overflow count and, per non-empty tensor, largest |g| (inf for NaN/inf).
        self._overflow = torch.zeros((), dtype=torch.int64, device=dev)
        self._max = torch.zeros(len(self._nonempty), dtype=torch.float64, device=dev)
        self.max_seen = [FIRST_MAX] * len(self.sizes)  # agreed maxima of the last step
        self.shifts = self._shifts(self.max_seen)
        self.loss = 0.0  # the committed step's loss sum (exact)

    @property
    def overflow(self) -> int:
        """Overflows counted in this step so far (one per tensor per microbatch, + the loss's)."""
        return int(self._overflow)

    @property
    def local_max(self) -> list[float]:
        """This step's largest |g| of each tensor so far (0 for a tensor never seen)."""
        out = [0.0] * len(self.sizes)
        for k, m in zip(self._nonempty, self._max.tolist(), strict=True):
            out[k] = m
        return out

    # -- per microbatch ------------------------------------------------------------------------
    def fold(self, loss: float) -> None:
        """Add the microbatch just computed (its gradient sits in the layout's tensors) to the
        accumulator, exactly, and clear those tensors for the next one."""
        flat = self._microbatch()
        self._rescale()
        self._count(flat)
        # g * 2^s is exact in g's own dtype (a power of two; `_count` left -g there, hence the
        # negative scale), its round too, and so is the integer-valued result's conversion to
        # int64: no float64 copy is needed. inf/NaN (counted as overflows: the step is redone)
        # become 0 rather than undefined integers.
        flat.mul_(self._scale).round_().nan_to_num_(0.0, 0.0, 0.0)
        for lo in range(0, flat.numel(), CHUNK):
            hi = min(lo + CHUNK, flat.numel())
            q = self._scratch[: hi - lo]
            q.copy_(flat[lo:hi])
            self.acc[lo:hi].add_(q)
        flat.zero_()
        q_loss = math.ldexp(loss, LOSS_BITS) if math.isfinite(loss) else math.inf
        if abs(q_loss) >= 2.0**self.limit_bits:
            self._overflow += 1
        else:
            self.acc[-1] += round(q_loss)

    def _microbatch(self) -> torch.Tensor:
        """The microbatch's local gradient as one flat buffer that may be overwritten: the
        layout's own where it has one, else a copy (and the layout's tensors cleared)."""
        flat = self.inner.local_flat()  # type: ignore[attr-defined]
        if flat is not None:
            return flat
        if self._own is None:
            dtype = self.inner.dtype  # type: ignore[attr-defined]
            self._own = torch.empty(self.numel - 1, dtype=dtype, device=self.device)
        self.inner.pack(self._own)  # type: ignore[attr-defined]
        parts = [p for p in self.inner.parts() if p is not None]  # type: ignore[attr-defined]
        if parts:
            torch._foreach_zero_(parts)
        return self._own

    def _count(self, flat: torch.Tensor) -> None:
        """Each tensor's max |g| into the step's maxima, and an overflow counted for each tensor
        whose max |g| * 2^s_k reaches 2^limit_bits or is not finite; leaves -g in `flat` (the
        max of -g is minus the min of g: no |g| buffer is made)."""
        if flat.data_ptr() != self._split[0]:
            views = flat.split(self.sizes)
            self._split = (flat.data_ptr(), [views[k] for k in self._nonempty])
        views = self._split[1]
        if not views:
            return
        top = torch.stack(torch._foreach_max(views))
        flat.neg_()
        m = torch.maximum(top, torch.stack(torch._foreach_max(views))).double()  # NaN stays
        # m * 2^s_k is exact in float64: the test is the comparison of powers of two it was.
        over = (m * self._pow >= 2.0**self.limit_bits) | m.isnan()
        self._overflow += over.sum()
        torch.maximum(self._max, m.nan_to_num_(math.inf, math.inf), out=self._max)

    def _rescale(self) -> None:
        """Rewrite the scale vectors where a tensor's shift changed (a few tensors a step: a
        whole rebuild cost about half a fold)."""
        if self._scale_for == self.shifts:
            return
        old = self._scale_for or [None] * len(self.sizes)
        for k, s in enumerate(self.shifts):
            if old[k] != s:
                o = self._offsets[k]
                self._scale[o: o + self.sizes[k]].fill_(-(2.0**s))
        pows = [2.0 ** self.shifts[k] for k in self._nonempty]
        self._pow.copy_(torch.tensor(pows, dtype=torch.float64))
        self._scale_for = list(self.shifts)

    # -- GradAccess ----------------------------------------------------------------------------
    def pack(self, into: torch.Tensor) -> None:
        into.copy_(self.acc)

    def assign(self, reduced: torch.Tensor) -> None:
        self.loss = math.ldexp(float(reduced[-1]), -LOSS_BITS)
        self._rescale()
        # The integer rounded once to float32, then divided by 2^s_k (exact: a power of two;
        # the scale is -2^s_k, hence the negation), written straight into a float32 layout's
        # own buffer, never through a float64 copy of the whole gradient.
        flat = self.inner.local_flat()  # type: ignore[attr-defined]
        direct = flat is not None and flat.dtype == torch.float32
        out = flat if direct else torch.empty(self.numel - 1, dtype=torch.float32,
                                              device=self.device)
        out.copy_(reduced[:-1])
        out.div_(self._scale).neg_()
        if not direct:
            self.inner.assign(out)  # type: ignore[attr-defined]

    def zero(self) -> None:
        self.acc.zero_()
        self.inner.zero()  # type: ignore[attr-defined]
        self._max.zero_()
        self._overflow.zero_()

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
            out.append(min(MAX_SHIFT, self.limit_bits - HEADROOM_BITS - e))
        return out
