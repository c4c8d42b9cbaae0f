"""Exact mode: the step's gradient is bitwise independent of grouping, order and faults.

Unit tests fold integer-exact and random per-id gradients in different groupings through
`ExactGrads`; the process tests compare whole runs bit for bit (losses at every step, final
parameters), with real SIGKILLs, and against the default mode's order noise.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.runs import LAYOUT_FLAGS, bitwise_equal, recover_train
from recover.layouts.plain import FlatGrads
from recover.layouts.sharded import ShardedGrads
from recover.recovery.exact import FIRST_MAX, ExactGrads, ExactOverflow


class _Layout:
    """A real layout (the plain one's flat buffer, or separate tensors as under FSDP2) over a
    few float32 parameters; `put` adds a microbatch's gradient as backward would."""

    def __init__(self, shapes: list[int], flat: bool = True) -> None:
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)
        self.grads = FlatGrads(self.params) if flat else ShardedGrads(self.params)

    def put(self, values: list[torch.Tensor]) -> None:
        for p, v in zip(self.params, values, strict=True):
            if p.grad is None:
                p.grad = v.clone()
            else:
                p.grad.add_(v)

    def read(self) -> list[torch.Tensor]:
        return [p.grad.clone() for p in self.params]


def _grads(n: int, shapes: list[int], seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # Widely spread magnitudes: float32 sums of these depend on their order.
    return [[torch.randn(s, generator=g) * 10.0 ** torch.randint(-6, 3, (s,), generator=g)
             for s in shapes] for _ in range(n)]


def _reduce(groups: list[list[int]], grads: list[list[torch.Tensor]], shapes: list[int],
            n: int, table_rows: int = 4, flat: bool = True, shifts: list[int] | None = None
            ) -> tuple[list[torch.Tensor], bool, list[ExactGrads]]:
    """Fold each group's ids on its own 'replica' (at `shifts`, if given), sum the accumulators
    (the all-reduce), assign the sum and agree on every replica: (replica 0's gradient, whether
    the step overflowed, every replica's ExactGrads)."""
    accs, reps = [], []
    for ids in groups:
        inner = _Layout(shapes, flat)
        ex = ExactGrads(inner.grads, n)
        if shifts is not None:
            ex.shifts = list(shifts)
        ex.zero()
        reps.append((inner, ex))
        for i in ids:
            inner.put(grads[i])
            ex.fold(loss=float(i) / 7)
        accs.append(ex.acc.clone())
    total = torch.stack(accs).sum(0)
    table = torch.zeros(table_rows, reps[0][1].slots, dtype=torch.float64)
    for r, (_, ex) in enumerate(reps):
        table[r] = torch.tensor(ex.slot_values(), dtype=torch.float64)
    overflowed = set()
    for _, ex in reps:
        ex.assign(total.clone())
        overflowed.add(ex.agree(table))
    assert len(overflowed) == 1  # every replica decides alike
    return reps[0][0].read(), overflowed.pop(), [ex for _, ex in reps]


@pytest.mark.parametrize("flat", [True, False], ids=["flat-buffer", "separate-tensors"])
def test_any_grouping_and_order_gives_the_same_bits(flat: bool) -> None:
    shapes, n = [33, 1, 0, 250], 8
    grads = _grads(n, shapes)
    ids = list(range(n))
    groupings = [[ids[0:2], ids[2:4], ids[4:6], ids[6:8]], [ids[0:3], ids[3:6], ids[6:8]],
                 [ids], [[7, 3, 1], [0, 6], [5, 2, 4]]]
    results = [_reduce(gr, grads, shapes, n, flat=flat) for gr in groupings]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][0], r[0], strict=True))
    # The next step's exponents: the same on every replica of every grouping, set from the
    # sum's largest |g| per tensor (the empty tensor keeps the first bound).
    shifts = {tuple(ex.shifts) for r in results for ex in r[2]}
    assert len(shifts) == 1
    exact64 = [sum((grads[i][k].double() for i in ids), torch.zeros(s, dtype=torch.float64))
               for k, s in enumerate(shapes)]
    want = [float(t.abs().max()) if t.numel() else FIRST_MAX for t in exact64]
    top = [float(t.abs().max()) if t.numel() else FIRST_MAX for t in results[0][0]]
    assert results[0][2][0].max_seen == top
    assert all(abs(a - b) <= b * 2.0**-23 for a, b in zip(top, want, strict=True))
    # The float32 sum in different orders is NOT bitwise stable on these values (so the test
    # above could fail), yet the exact sum stays within float32 rounding of the float64 sum.
    orders = [ids, ids[::-1], random.Random(1).sample(ids, n)]
    f32 = [sum((grads[i][3] for i in o), torch.zeros(shapes[3])) for o in orders]
    assert not all(torch.equal(f32[0], x) for x in f32[1:])
    rel = (results[0][0][3].double() - exact64[3]).abs() / exact64[3].abs().clamp_min(1e-30)
    assert float(rel.max()) <= 2.0**-23  # one float32 rounding of the exact sum


def test_overflow_is_detected_and_the_redo_fits() -> None:
    shapes, n = [16, 5], 4
    grads = _grads(n, shapes, seed=3)
    grads[2][0][5] = 2.0**40  # far past the first step's assumed bound (2^10) + headroom
    _, overflowed, exes = _reduce([[0, 1], [2, 3]], grads, shapes, n)
    assert overflowed
    # Every shift drops by the bits the largest value was over the headroom, on every replica.
    first = ExactGrads(_Layout(shapes).grads, n).shifts
    drop = first[0] - exes[0].shifts[0]
    assert drop > 0 and all(ex.shifts == [s - drop for s in first] for ex in exes)
    # Redo at those exponents, grouped another way: no overflow, and the exact sum.
    got, overflowed, _ = _reduce([[3], [0, 2, 1]], grads, shapes, n, shifts=exes[0].shifts)
    assert not overflowed
    want = sum((g[0].double() for g in grads), torch.zeros(16, dtype=torch.float64))
    # Fixed point keeps (62 - log2 N - headroom) bits below the largest value: each of the N
    # terms is truncated by less than a quantum, then one float32 rounding.
    quantum = 2.0 ** -exes[0].shifts[0]
    err = (got[0].double() - want).abs()
    assert bool((err <= n * quantum + want.abs() * 2.0**-24).all())


@pytest.mark.parametrize("flat", [True, False], ids=["flat-buffer", "separate-tensors"])
def test_overflows_are_counted_per_microbatch_with_the_largest_value(flat: bool) -> None:
    """One overflow per microbatch whose largest |g * 2^s_k| reaches the bound or is not finite
    (+ one for a loss that does), and the step's largest such value (NaN once one was): what the
    trailer carries."""
    inner = _Layout([3, 0, 2, 4], flat)
    ex = ExactGrads(inner.grads, 8)
    ex.set_maxima([1.0, 1.0, 1.0, 2.0**-4])  # |g| * 2^48 < 2^59 iff |g| < 2^11 (2^15 last)
    assert ex.shifts == [48, 48, 48, 52]
    ex.zero()
    t = torch.tensor

    def fold(a: list[float], b: list[float], c: list[float], loss: float = 1.0) -> None:
        inner.put([t(a), t([]), t(b), t(c)])
        ex.fold(loss)

    fold([0.5, -(2.0**11 - 2.0**-12), 1.0], [0.25, 1.0], [-0.75, 0.5, 0.0, 2.0**-3])
    assert (ex.overflow, ex.peak) == (0, (2.0**11 - 2.0**-12) * 2.0**48)  # just below the bound
    fold([0.5, -(2.0**20), 1.0], [0.25, 1.0], [0.0] * 4)
    assert (ex.overflow, ex.peak) == (1, 2.0**68)
    fold([0.0, 0.0, 0.0], [0.0, 0.0], [0.0, -(2.0**7), 0.0, 0.0])  # at the bound: 2^7 * 2^52
    assert (ex.overflow, ex.peak) == (2, 2.0**68)
    fold([0.0] * 3, [0.0] * 2, [0.0] * 4, loss=float("inf"))
    assert (ex.overflow, ex.peak) == (3, 2.0**68)
    fold([0.0] * 3, [float("nan"), 0.0], [0.0, float("-inf"), 0.0, 0.0])
    assert ex.overflow == 4 and ex.peak != ex.peak  # NaN
    assert all(float(g.abs().sum()) == 0.0 for g in inner.read())  # each fold clears the grads
    ex.zero()
    assert (ex.overflow, ex.peak) == (0, 0.0)


def test_a_step_no_shift_can_fit_raises() -> None:
    """A NaN or inf gradient, or a loss past the bound, overflows at any shift: agree raises
    rather than redo the step for ever."""
    ex = ExactGrads(_Layout([4]).grads, 8)
    for peak in (float("nan"), float("inf"), 2.0**20):  # 2^20: only the loss overflowed
        with pytest.raises(ExactOverflow, match="cannot be summed in fixed point"):
            ex.agree(torch.tensor([[1.0, peak], [0.0, 0.0]], dtype=torch.float64))


# -- whole runs: real processes, real SIGKILLs ------------------------------------------------
# 60 steps: without --exact, runs grouped differently first differ at step ~39 (issue #15
# measured it on this preset; the quotas regroup from step 0), so the kills at 10, 25 and 40
# leave room to differ; its acceptance command runs 200.
EXACT = ["--preset", "debug", "--exact", "--steps", "60", "--eval-every", "0",
         "--n-layer", "1", "--n-embd", "32", "--dump-final-params"]


@pytest.fixture(scope="module")
def exact_ref(corpus: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    run = recover_train(tmp_path_factory.mktemp("exact") / "ref", *EXACT,
                        data=corpus, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_faults_and_other_quotas_are_bitwise_the_failure_free_run(
        exact_ref, corpus: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One run groups the reference's N ids two other ways: speed-aware quotas around a 3x
    straggler (replica 3, until it is killed: fewer microbatches than the reference's equal
    split), and real SIGKILLs in three phases (the lost ids recomputed by survivors). Every
    step's loss and the last survivor's parameters are bitwise the reference's."""
    run = recover_train(tmp_path / "run", *EXACT, "--speed-aware",
                        "--fault", "slow:replica=3,factor=3",
                        "--fault", "kill:replica=1,step=10,phase=backward",
                        "--fault", "kill:replica=2,step=25,phase=reduce",
                        "--fault", "kill:replica=3,step=40,phase=commit",
                        data=corpus, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert any(r["quotas"] != {"0": 2, "1": 2, "2": 2, "3": 2} for r in recs[:10]), \
        [r["quotas"] for r in recs[:10]]
    assert recs[-1]["live_replicas"] == 1 and sum(len(r["recovered"]) for r in recs) > 0
    assert run.losses() == exact_ref.losses()  # bitwise, every step
    assert bitwise_equal(run.final(0), exact_ref.final(0))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["plain", "hsdp"])
def test_a_resumed_run_is_bitwise_the_uninterrupted_one(
        exact_ref, corpus: Path, tmp_path: Path, layout: str) -> None:  # type: ignore[no-untyped-def]
    """--stop-at, then --resume: the checkpoint holds each rank's exponents (hsdp: one list per
    shard), so every later step's loss and the final parameters are bitwise the run that never
    stopped (resumed at the first step's exponents instead, the later losses differed)."""
    # hsdp runs its own reference, shorter: the exponents follow the last step's gradients, so
    # any resume past the first steps needs the saved ones; three runs of four ranks stay cheap.
    steps, stop = (60, 25) if layout == "plain" else (30, 12)
    args = [*EXACT, *(LAYOUT_FLAGS["hsdp"] + ["--replicas", "2", "--steps", str(steps)]
                      if layout == "hsdp" else [])]
    ref = exact_ref if layout == "plain" else recover_train(tmp_path / "ref", *args,
                                                            data=corpus, timeout=400)
    out = tmp_path / "run"
    first = recover_train(out, *args, "--stop-at", str(stop), data=corpus, timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    second = recover_train(out, *args, "--resume", data=corpus, timeout=400)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"--resume from step_{stop:08d}" in second.stderr
    assert [r["step"] for r in second.metrics()] == list(range(steps))
    assert second.losses() == ref.losses()  # bitwise, every step
    names = sorted(p.name for p in (ref.out / "final").iterdir())  # a file per replica (rank)
    assert names == sorted(p.name for p in (out / "final").iterdir()) and names
    for name in names:
        assert bitwise_equal(*(torch.load(r / "final" / name, weights_only=True)
                               for r in (ref.out, out))), name


@pytest.mark.timeout(180)
def test_a_diverged_run_ends_with_one_line(corpus: Path, tmp_path: Path) -> None:
    """A learning rate that sends the loss to NaN at step 2: no fixed point holds that step, so
    every replica ends with the reason in one line (before, each redid the step for ever)."""
    run = recover_train(tmp_path / "run", "--preset", "debug", "--exact", "--lr", "1e4",
                        "--steps", "30", "--eval-every", "0", data=corpus, timeout=120)
    assert run.returncode != 0, run.stdout[-2000:]
    for r in range(4):
        log = (tmp_path / "run" / "logs" / f"replica{r}.log").read_text()
        assert "cannot be summed in fixed point" in log and "Traceback" not in log, log[-2000:]
