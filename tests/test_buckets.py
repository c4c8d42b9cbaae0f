"""The reduction's buckets (`recover.recovery.buckets`): a pure plan every member computes alike,
and the order an overlapped backward issues them in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recover.layouts.plain import FlatGrads
from recover.recovery.buckets import FIRST_BUCKET_BYTES, BucketPlan, Overlap, StreamedGrad

MIB = 1 << 20


@pytest.mark.parametrize("mb", [0.0, 0.001, 0.05, 1.0, 25.0])
def test_plan_tiles_the_gradient_from_the_last_parameter(mb: float) -> None:
    sizes = [300, 7, 50_000, 1, 120_000, 4096, 64]
    plan = BucketPlan.make(sizes, 4, mb)
    # Contiguous, descending, the last one (issued last, with the trailer) starting at 0.
    assert plan.ranges[0][1] == sum(sizes) and plan.ranges[-1][0] == 0
    assert all(a[0] == b[1] for a, b in zip(plan.ranges, plan.ranges[1:], strict=False))
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    for k, b in enumerate(plan.of):  # every parameter inside its bucket, buckets at boundaries
        lo, hi = plan.ranges[b]
        assert lo <= offsets[k] and offsets[k] + sizes[k] <= hi
    assert plan.of == sorted(plan.of, reverse=True)
    if mb == 0.0:
        assert plan.ranges == [(0, sum(sizes))]
    else:  # a bucket is closed by the parameter that brings it to its cap (the first issued:
        # at most 1 MiB), and not before
        caps = [min(mb * MIB, FIRST_BUCKET_BYTES)] + [mb * MIB] * len(sizes)
        for b, (lo, hi) in enumerate(plan.ranges[:-1]):
            closing = min(k for k in range(len(sizes)) if plan.of[k] == b)
            assert (hi - lo) * 4 >= caps[b] > (hi - lo - sizes[closing]) * 4


def test_overlap_issues_in_plan_order_as_parameters_finish() -> None:
    plan = BucketPlan.make([10, 10, 10, 10], 4, 10 * 4 / MIB)  # one parameter a bucket
    assert plan.ranges == [(30, 40), (20, 30), (10, 20), (0, 10)]
    issued: list[tuple[int, int]] = []
    firsts: list[int] = []
    ov = Overlap(plan, lambda lo, hi: issued.append((lo, hi)), lambda: firsts.append(1))
    ov.ready(2)  # bucket 1 finished before bucket 0: it waits for it
    assert issued == []
    ov.ready(3)
    assert issued == [(30, 40), (20, 30)] and firsts == [1]
    ov.ready(0)  # the last bucket travels with the trailer, after the backward: never here
    assert issued == [(30, 40), (20, 30)]
    ov.flush()  # parameter 1 never reported (unused in this microbatch): issued at the end
    assert issued == [(30, 40), (20, 30), (10, 20)] and firsts == [1]


def test_flat_grads_report_each_parameter_once_per_backward() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    grads = FlatGrads(model)
    assert isinstance(grads, StreamedGrad)
    seen: list[int] = []
    grads.on_final(seen.append)
    model(torch.randn(3, 4)).sum().backward()
    assert sorted(seen) == [0, 1, 2, 3] and seen[0] in (2, 3)  # the last layer finishes first
    grads.on_final(None)
    model(torch.randn(3, 4)).sum().backward()
    assert len(seen) == 4
