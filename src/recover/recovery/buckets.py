"""The cross-replica reduction in buckets, overlapped with the last microbatch's backward.

Invariants:
- Every member issues the same operations in the same order, overlapped or not: the buckets are
  a pure function of the layout's parameter sizes and `Numerics.bucket_mb`, issued from the
  last parameters to the first (the order a backward finishes them in), and the last operation is
  always the first bucket together with the trailer. So a member that overlaps (it computed this
  attempt) and one that does not (it recomputes nothing, or redoes the reduce) meet in every
  operation, and a bucket's sum is over the same members as the trailer's: the trailer, verified
  in the last operation, proves the whole reduction, because one group's operations complete in
  order on every member or fail.
- A bucket is packed and issued only once every parameter in it has its final local gradient of
  the step (autograd's post-accumulate hook in the step's last microbatch) and every bucket
  before it has been issued; the local gradient is still never modified (the bucket is copied
  into the scratch buffer), so a failed attempt reduces it again from scratch.
- Nothing is applied before the step's decision: an overlapped bucket only fills the scratch
  buffer, exactly as the reduction after the backward does.

Why: in DDP the gradient's all-reduce runs while the backward still computes the earlier layers'
gradients; without it the whole reduction waits for the whole backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

# The first bucket issued is capped at this, as DDP's is (1 MiB): it starts the wire early.
FIRST_BUCKET_BYTES = 1 << 20


@runtime_checkable
class StreamedGrad(Protocol):
    """A `GradAccess` whose local gradient is one flat tensor (`local_flat()`, the parameters'
    `sizes` in pack order) and that tells, during a backward, when parameter k's part of it is
    final (`on_final(ready)`: `ready(k)` from autograd; None stops it)."""

    sizes: list[int]

    def local_flat(self) -> torch.Tensor: ...

    def on_final(self, ready: Callable[[int], None] | None) -> None: ...


@dataclass(frozen=True)
class BucketPlan:
    """Buckets of the packed gradient, in issue order: `ranges[b]` = [lo, hi) elements,
    descending; the last one starts at 0 (it travels with the trailer). `of[k]`: parameter
    k's bucket."""

    ranges: list[tuple[int, int]]
    of: list[int]

    @classmethod
    def make(cls, sizes: Sequence[int], elem_bytes: int, bucket_mb: float) -> BucketPlan:
        """Walk the parameters from the last to the first, closing a bucket once it holds
        `bucket_mb` MiB (the first one issued: at most `FIRST_BUCKET_BYTES`). 0: one bucket."""
        numel = sum(sizes)
        if bucket_mb <= 0 or not sizes:
            return cls([(0, numel)], [0] * len(sizes))
        cap = max(1, int(bucket_mb * (1 << 20)) // elem_bytes)
        first = max(1, min(cap, FIRST_BUCKET_BYTES // elem_bytes))
        ranges: list[tuple[int, int]] = []
        of = [0] * len(sizes)
        hi = lo = numel
        for k in range(len(sizes) - 1, -1, -1):
            lo -= sizes[k]
            of[k] = len(ranges)
            if hi - lo >= (cap if ranges else first) and k > 0:
                ranges.append((lo, hi))
                hi = lo
        ranges.append((0, hi))
        return cls(ranges, of)


@dataclass
class Overlap:
    """One attempt's buckets issued from inside the last microbatch's backward.

    `issue(lo, hi)` packs elements [lo, hi) of the local gradient and starts their reduction;
    `on_first()` runs once, after the first overlapped bucket was issued (fault injection).
    Everything but the last bucket may be issued here; `flush` issues the ones whose
    parameters never reported (unused in this microbatch) once the backward returned."""

    plan: BucketPlan
    issue: Callable[[int, int], None]
    on_first: Callable[[], None]
    issued: int = 0  # buckets issued so far, in plan order
    left: list[int] = field(default_factory=list)  # per bucket: parameters not final yet
    final: set[int] = field(default_factory=set)  # parameters that reported

    def __post_init__(self) -> None:
        self.left = [0] * len(self.plan.ranges)
        for b in self.plan.of:
            self.left[b] += 1

    def ready(self, k: int) -> None:
        """Parameter k's local gradient is final (autograd's hook, on the backward's thread).
        A second report means a second backward: its bucket may be on the wire already."""
        if k in self.final:
            raise RuntimeError(
                f"parameter {k} finished a second backward in the step's last microbatch; "
                "a compute that runs more than one backward per microbatch needs "
                "Numerics(bucket_mb=0)")
        self.final.add(k)
        self.left[self.plan.of[k]] -= 1
        last = len(self.plan.ranges) - 1
        while self.issued < last and self.left[self.issued] <= 0:
            self.issue(*self.plan.ranges[self.issued])
            self.issued += 1
            if self.issued == 1:
                self.on_first()

    def flush(self) -> None:
        """Issue every bucket but the last that is not issued yet."""
        last = len(self.plan.ranges) - 1
        for b in range(self.issued, last):
            self.issue(*self.plan.ranges[b])
        self.issued = last
