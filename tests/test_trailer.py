"""The reduce's trailer codec (recover.recovery.trailer): exact whatever the summation order, at
the proven limits, in every buffer dtype that carries it; and a float32 step is one collective.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from harness.inproc import Harness
from recover.recovery.trailer import MAX_REPLICAS, Trailer, carries

pytestmark = pytest.mark.timeout(120)
CARRIERS = [torch.float32, torch.float64, torch.int64]


def _contribute(t: Trailer, ints: tuple[int, int, int], me: int, row: list[float]
                ) -> torch.Tensor:
    buf = torch.full((t.size,), 7, dtype=t.dtype)  # encode must overwrite everything
    t.encode(buf, ints, me, row)
    return buf


@pytest.mark.parametrize("dtype", CARRIERS)
def test_sums_in_any_order_decode_exactly(dtype: torch.dtype) -> None:
    rng = random.Random(3)
    reps, slots = 9, 2
    t = Trailer(reps, slots, dtype)
    members = [0, 2, 3, 5, 8]
    specials = [math.nan, -math.inf, math.inf, 5e-324, -1e308, 1e-310]
    rows, ints, bufs = {}, [0, 0, 0], []
    for m in members:
        i = (rng.randrange(1 << 20), rng.randrange(1 << 50), rng.randrange(1 << 40))
        ints = [a + b for a, b in zip(ints, i, strict=True)]
        rows[m] = [rng.uniform(-50, 50), rng.random(), rng.choice(specials), rng.random()]
        bufs.append(_contribute(t, i, m, rows[m]))
    sums = []
    for _ in range(3):  # the collective may add in any order: every order gives the same bits
        rng.shuffle(bufs)
        total = torch.zeros(t.size, dtype=dtype)
        for b in bufs:
            total += b
        sums.append(t.decode(total))
    assert all(torch.equal(s.view(torch.int64), sums[0].view(torch.int64)) for s in sums)
    d = sums[0]
    assert [int(x) for x in d[:3].tolist()] == ints
    assert d[3].item() == pytest.approx(sum(r[0] for r in rows.values()), rel=1e-15)
    times = d[4:4 + reps].tolist()
    table = d[4 + reps:].view(reps, slots).tolist()
    for m in range(reps):
        want = rows.get(m, [0.0, 0.0, 0.0, 0.0])
        got = [times[m], *table[m]]
        # exactly, infinities, NaN and subnormals included (a row is one value plus zeros)
        assert [repr(v) for v in got] == [repr(v) for v in want[1:]], (m, got, want)


def test_float32_limbs_hold_at_the_limits() -> None:
    """MAX_REPLICAS members, each with every limb at its maximum: the float32 sums stay exact."""
    t = Trailer(4, 0, torch.float32)
    v = (1 << 36) - 1  # 36 bits set: limbs of 255; 2^16 of them sum to < 2^53
    one = _contribute(t, (v, v, v), 0, [0.0, 0.0])
    total = one * MAX_REPLICAS  # = the sum of 2^16 copies (integers < 2^24: exact in float32)
    assert float(total.max()) == 255 * MAX_REPLICAS < 2**24
    assert [int(x) for x in t.decode(total)[:3].tolist()] == [v * MAX_REPLICAS] * 3


def test_half_precision_cannot_carry_it() -> None:
    assert not carries(torch.bfloat16) and not carries(torch.float16)
    with pytest.raises(ValueError, match="cannot carry the trailer exactly"):
        Trailer(4, 0, torch.bfloat16)
    with pytest.raises(ValueError, match="replicas exceed 65536"):
        Trailer(MAX_REPLICAS + 1, 0, torch.float32)


@pytest.mark.parametrize("dtype,per_step", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_collectives_per_step(tmp_path: Path, dtype: torch.dtype, per_step: int) -> None:
    """float32 gradients carry the trailer in their own buffer: one collective a step; bf16
    needs the float64 trailer beside it. The figures stay exact either way (Harness.check)."""
    h = Harness(tmp_path, 3, n=8, steps=4, numel=64, dtype=dtype).run()
    if dtype == torch.float32:
        h.check([0, 1, 2])
    for rank in h.ranks.values():
        assert rank.engine.comm.stats["collectives"] == per_step * h.steps, rank.name
        assert all(res.microbatches == 8 for res, _ in rank.results.values())
