"""Exact mode: a step's gradient that is bitwise the same however its microbatches are grouped.

Each microbatch's gradient is folded, right after its backward, into a 64-bit fixed-point
accumulator: tensor k's elements become integers `trunc(g * 2^s_k)`. Integer addition is
associative, so the sum over the step's N microbatches, within a replica and then across replicas
(an int64 all-reduce), is the same integer in any order, on any grouping, after any fault. The
step's gradient is that integer times 2^-s_k, rounded once to the gradient's dtype; the loss is
summed the same way at a fixed scale.

Invariants:
- `s_k` is a pure function of the previous committed step's gradient: its largest |g| in tensor
  k, read from the reduced sum, which every replica holds bit for bit; so every replica uses the
  same exponents, with nothing per tensor in the trailer.
- No sum can overflow: a microbatch whose largest |g * 2^s_k| over all tensors reaches
  2^62 / 2^ceil(log2 N) (or is not finite) raises the step's overflow count; every replica sees
  the count, and that largest value (a max is grouping-independent), in the reduced trailer, and
  the step is redone from scratch with every shift lowered until that value fits under the
  headroom. A step no shift can fit (a NaN or inf gradient or loss) raises `ExactOverflow`.
- Exponents start with 2^HEADROOM_BITS of headroom over the previous step's largest |g|, so an
  overflow needs a microbatch's share 2^HEADROOM_BITS times larger than that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from recover.errors import RecoverError

HEADROOM_BITS = 10  # a microbatch's share may be 1024x larger than the last step's largest |g|
LOSS_BITS = 32  # the loss is summed as round(loss * 2^32): exact to 2.3e-10
FIRST_MAX = 2.0**10  # the bound assumed before any step was seen
# Shifts stay where 2^s and 2^-s are both normal float32 numbers, so the per-element scale
# vector and its inverse are exact powers of two (only a tensor whose largest |g| is < 2^-74
# gets fewer than the usual bits).
MAX_SHIFT = 126
# Elements converted to int64 and summed per operation: a 512 KiB int64 scratch that stays in
# cache, faster than larger or smaller chunks (docs/MEASUREMENTS.md, "Exact mode's cost").
CHUNK = 1 << 16


class ExactOverflow(RecoverError):
    """A step's gradient or loss that no fixed point holds (NaN, inf, or |loss| past
    2^(30 - ceil(log2 N))): running it again would overflow again (training diverged)."""


class ExactGrads:
    """A `GradAccess` over an int64 accumulator, around a layout's float gradients.

    `inner` is the layout's `GradAccess` that also gives `sizes`, `parts()` (its local gradient
    tensors in pack order, None where none exists yet) and `local_flat()` (the one buffer every
    local gradient is a view of, or None where there is none: then each microbatch is packed
    into a buffer of this class's first). The trailer slots this adds per replica are
    [overflow count, largest |g * 2^s_k| of the step's microbatches].

    A fold is five whole-buffer operations whatever the number of tensors, and no device-to-host
    copy: the multiply by a per-element -2^s_k, one `aminmax` (the overflow test, kept on the
    device with the running largest value, read once per step by `slot_values`), the int64
    conversion and sum in chunks, the clearing. The per-tensor maxima that set the next shifts
    are read once per step, from the reduced sum (`assign`).
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
        # Per-element -2^s_k and the shifts it holds: rewritten only where a shift changes.
        # Negative so that the reduced sum comes back as -g, whose per-tensor max is minus the
        # min of g: `assign` reads both maxima with no |g| buffer and no extra pass.
        self._scale = torch.empty(n_grad, dtype=torch.float32, device=dev)
        self._scale_for: list[int] = []
        self._offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        # This step's overflow count and largest |g * 2^s_k| (NaN or inf where one was).
        self._overflow = torch.zeros((), dtype=torch.int64, device=dev)
        self._peak = torch.zeros((), dtype=torch.float32, device=dev)
        self.max_seen = [FIRST_MAX] * len(self.sizes)  # agreed maxima of the last step
        self.shifts = self._shifts(self.max_seen)
        self._sum_max = [0.0] * len(self.sizes)  # the last assigned sum's largest |g| per tensor
        self.loss = 0.0  # the committed step's loss sum (exact)

    @property
    def overflow(self) -> int:
        """Overflows counted in this step so far (one per microbatch that overflowed, + one per
        loss that did)."""
        return int(self._overflow)

    @property
    def peak(self) -> float:
        """This step's largest |g * 2^s_k| so far, over every tensor (NaN or inf if one was)."""
        return float(self._peak)

    # -- per microbatch ------------------------------------------------------------------------
    def fold(self, loss: float) -> None:
        """Add the microbatch just computed (its gradient sits in the layout's tensors) to the
        accumulator, exactly, and clear those tensors for the next one."""
        flat = self._microbatch()
        self._rescale()
        # g * -2^s is exact in g's own dtype (a power of two), and so is its truncation to int64
        # below 2^limit_bits. Past it (or for inf/NaN) the conversion's value is undefined, but
        # the microbatch is counted as an overflow and the whole step is redone: its integers
        # are never applied.
        flat.mul_(self._scale)
        lo, hi = torch.aminmax(flat)
        top = torch.maximum(hi, lo.neg())  # NaN stays NaN
        self._overflow += ((top >= 2.0**self.limit_bits) | top.isnan()).to(torch.int64)
        torch.maximum(self._peak, top, out=self._peak)
        for lo_ in range(0, flat.numel(), CHUNK):
            hi_ = min(lo_ + CHUNK, flat.numel())
            q = self._scratch[: hi_ - lo_]
            q.copy_(flat[lo_:hi_])
            self.acc[lo_:hi_].add_(q)
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

    def _rescale(self) -> None:
        """Rewrite the scale vector where a tensor's shift changed (a few tensors a step: a
        whole rewrite cost about half a fold)."""
        if self._scale_for == self.shifts:
            return
        old = self._scale_for or [None] * len(self.sizes)
        for k, s in enumerate(self.shifts):
            if old[k] != s:
                o = self._offsets[k]
                self._scale[o: o + self.sizes[k]].fill_(-(2.0**s))
        self._scale_for = list(self.shifts)

    # -- GradAccess ----------------------------------------------------------------------------
    def pack(self, into: torch.Tensor) -> None:
        into.copy_(self.acc)

    def assign(self, reduced: torch.Tensor) -> None:
        self.loss = math.ldexp(float(reduced[-1]), -LOSS_BITS)
        self._rescale()
        # The integer rounded once to float32, then divided by -2^s_k (exact: a power of two),
        # written straight into a float32 layout's own buffer, never through a float64 copy of
        # the whole gradient. On the way, each tensor's largest |g| for the next shifts: the max
        # of -g * 2^s_k (the sum as it comes), then of g, with no |g| buffer and no extra pass.
        flat = self.inner.local_flat()  # type: ignore[attr-defined]
        direct = flat is not None and flat.dtype == torch.float32
        out = flat if direct else torch.empty(self.numel - 1, dtype=torch.float32,
                                              device=self.device)
        out.copy_(reduced[:-1])
        views = self._views(out, cache=direct)  # not a temporary's: the cache would keep it
        low = torch.stack(torch._foreach_max(views)) if views else None
        out.div_(self._scale)
        if low is not None:
            both = torch.stack([low, torch.stack(torch._foreach_max(views))]).tolist()
            for k, a, b in zip(self._nonempty, *both, strict=True):
                self._sum_max[k] = max(math.ldexp(a, -self.shifts[k]), b)  # exact: 2^-s_k
        if not direct:
            self.inner.assign(out)  # type: ignore[attr-defined]

    def _views(self, flat: torch.Tensor, cache: bool) -> list[torch.Tensor]:
        """The non-empty tensors' views of `flat` (cached for the layout's own buffer)."""
        if flat.data_ptr() == self._split[0]:
            return self._split[1]
        views = flat.split(self.sizes)
        nonempty = [views[k] for k in self._nonempty]
        if cache:
            self._split = (flat.data_ptr(), nonempty)
        return nonempty

    def zero(self) -> None:
        self.acc.zero_()
        self.inner.zero()  # type: ignore[attr-defined]
        self._peak.zero_()
        self._overflow.zero_()

    # -- trailer slots and exponents -----------------------------------------------------------
    @property
    def slots(self) -> int:
        return 2

    def slot_values(self) -> list[float]:
        return [float(self.overflow), self.peak]

    def agree(self, table: torch.Tensor) -> bool:
        """Read every replica's slots (rows of `table`) from the reduced trailer; set the next
        exponents; return whether the step overflowed anywhere (then it must be redone).

        Without an overflow the next shifts come from the sum just assigned (every replica's is
        the same bits). With one, every shift drops by the bits the step's largest value was
        over the headroom, which fits every microbatch of the redo (the same gradients) under
        it."""
        if not bool(table[:, 0].sum() > 0):
            self.max_seen = [v if v > 0 else a
                             for v, a in zip(self._sum_max, self.max_seen, strict=True)]
            self.shifts = self._shifts(self.max_seen)
            return False
        peak = float(table[:, 1].max())
        drop = (math.frexp(peak)[1] - (self.limit_bits - HEADROOM_BITS)
                if math.isfinite(peak) else 0)
        if drop <= 0:  # only the loss overflowed, or a value no shift fits
            raise ExactOverflow(
                f"exact mode: a step's gradient or loss cannot be summed in fixed point (largest "
                f"|g * 2^s| {peak}; |loss| must stay below 2^{self.limit_bits - LOSS_BITS}): a "
                "NaN or inf gradient or loss; running the step again would overflow again")
        # The shifts drop directly, not through `_shifts`: one capped at MAX_SHIFT would not.
        self.max_seen = [m * 2.0**drop for m in self.max_seen]
        self.shifts = [s - drop for s in self.shifts]
        return True

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
