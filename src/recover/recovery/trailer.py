"""The reduce's trailer: the step's verification and per-replica facts, summed with the gradient.

The trailer holds the step's integers [count, id checksum, step mark], summed over the members,
and one row per replica [loss sum, seconds per microbatch, slot values...] that only that
replica writes (the others add zeros). `decode` gives it back as one float64 tensor,
[count, checksum, mark, loss sum over the rows, the rows' microbatch times..., the rows' slots...].

Invariant: every decoded value is exact, whatever order the collective adds in, because every
element of the encoding is an integer whose sum over at most MAX_REPLICAS members stays inside
the buffer dtype's exact range, or a value plus zeros:
- float64 (and int64): one element per integer (sums < 2^53), a row value as itself (float64)
  or its bit pattern (int64);
- float32: an integer as 7 limbs of 8 bits, a row value's 64 bits as 4 limbs of 16 bits (limb
  sums < 2^16 * 255 < 2^24, exact in float32).
So a float32 or float64 (or exact-mode int64) gradient carries the trailer in its own buffer and
the step needs one collective, not two; bf16 and fp16 cannot hold such integers exactly, and
their trailer travels beside the gradient in float64 (a second collective).
"""

from __future__ import annotations

import torch

from recover.settings import MAX_REPLICAS  # 2^16 * 255 < 2^24: float32 limb sums stay exact

INTS = 3  # count, id checksum, step mark
ROW = 2  # loss sum, seconds per microbatch; then the slots
_LIMBS = {torch.float64: (1, 1), torch.int64: (1, 1), torch.float32: (7, 4)}
_INT_SHIFTS = torch.arange(0, 56, 8, dtype=torch.int64)  # float32: an integer's 7 limbs
_ROW_SHIFTS = torch.arange(0, 64, 16, dtype=torch.int64)  # float32: a row value's 4 limbs


def carries(dtype: torch.dtype) -> bool:
    """Whether a buffer of `dtype` can carry the trailer exactly (else it goes in float64)."""
    return dtype in _LIMBS


class Trailer:
    """The encoding of one engine's trailer in a buffer of `dtype` (one that `carries`)."""

    def __init__(self, replicas: int, slots: int, dtype: torch.dtype) -> None:
        if not carries(dtype):
            raise ValueError(f"a {dtype} buffer cannot carry the trailer exactly")
        if replicas > MAX_REPLICAS:
            raise ValueError(f"{replicas} replicas exceed {MAX_REPLICAS}")
        self.replicas, self.width, self.dtype = replicas, ROW + slots, dtype
        self.int_limbs, self.row_limbs = _LIMBS[dtype]
        self.size = INTS * self.int_limbs + replicas * self.width * self.row_limbs

    def encode(self, into: torch.Tensor, ints: tuple[int, int, int], me: int,
               row: list[float]) -> None:
        """Write this replica's contribution into `into` (`size` elements of `dtype`)."""
        into.zero_()
        k = INTS * self.int_limbs
        start = k + me * self.width * self.row_limbs
        span = into[start: start + len(row) * self.row_limbs]
        if self.dtype == torch.float32:
            into[:k] = ((torch.tensor(ints, dtype=torch.int64)[:, None] >> _INT_SHIFTS) & 0xFF
                        ).flatten().to(into.device, torch.float32)
            bits = torch.tensor(row, dtype=torch.float64).view(torch.int64)
            span.copy_(((bits[:, None] >> _ROW_SHIFTS) & 0xFFFF).flatten().to(torch.float32))
        else:
            into[:k] = torch.tensor(ints, dtype=self.dtype)
            vals = torch.tensor(row, dtype=torch.float64)
            span.copy_(vals.view(torch.int64) if self.dtype == torch.int64 else vals)

    def decode(self, reduced: torch.Tensor) -> torch.Tensor:
        """The summed trailer as float64: [count, checksum, mark, loss sum, times..., slots...]."""
        r = reduced.detach().to("cpu")
        k = INTS * self.int_limbs
        if self.dtype == torch.float32:
            limbs = r[:k].to(torch.int64).view(INTS, self.int_limbs)
            ints = (limbs << _INT_SHIFTS).sum(1)
            parts = r[k:].to(torch.int64).view(-1, self.row_limbs)
            low = (parts[:, :3] << _ROW_SHIFTS[:3]).sum(1)
            top = parts[:, 3] - (parts[:, 3] >= 0x8000).to(torch.int64) * 0x10000  # signed
            rows = ((top << 48) + low).view(torch.float64)  # no int64 overflow on the way
        elif self.dtype == torch.int64:
            ints, rows = r[:k], r[k:].clone().view(torch.float64)
        else:
            ints, rows = r[:k], r[k:]
        rows = rows.view(self.replicas, self.width)
        head = torch.cat([ints.to(torch.float64), rows[:, 0].sum().reshape(1)])
        return torch.cat([head, rows[:, 1], rows[:, ROW:].flatten()])
