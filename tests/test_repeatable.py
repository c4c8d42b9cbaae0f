"""A failure-free run repeats bit for bit: the same seed, data and N give the same losses, the
same parameter digests at every step and the same final parameters, whatever the timing, at any
replica count (N not divisible by R included), in every layout and both numerics modes.

Before 0.17 speed-aware quotas followed the clock by default: at R=5 two identical runs regrouped
microbatches at different steps and drifted apart (MEASUREMENTS.md, "Repeatable failure-free
runs"), while every other test ran at R=4, where the noise happened to round away.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.runs import LAYOUT_FLAGS, Run, bitwise_equal, recover_train

pytestmark = pytest.mark.slow

DEBUG = ["--preset", "debug", "--eval-every", "0", "--dump-final-params"]
# (replicas, N, steps, extra flags): the acceptance's three plain runs at 40 steps, then the
# layouts and exact mode on shorter runs (drift, when there is any, shows within a few steps).
CASES = {
    "plain-R3-N9": (3, 9, 40, []),
    "plain-R5-N10": (5, 10, 40, []),
    "plain-R7-N10": (7, 10, 40, []),
    "plain-R2-N5": (2, 5, 5, []),
    "hsdp-R3-N7": (3, 7, 4, LAYOUT_FLAGS["hsdp"]),
    "tp-R2-N5": (2, 5, 3, LAYOUT_FLAGS["tp"]),
    "pp-R2-N5": (2, 5, 3, LAYOUT_FLAGS["pp"]),
}  # and exact mode, R=5, N=7: the session's `exact_pair` (tests/conftest.py)


def _pair(tmp_path: Path, corpus: Path, replicas: int, n: int, steps: int,
          extra: list[str]) -> tuple[Run, Run]:
    args = [*DEBUG, "--replicas", str(replicas), "--microbatches", str(n), "--steps", str(steps),
            *extra]
    runs = tuple(recover_train(tmp_path / f"run{i}", *args, data=corpus, timeout=200)
                 for i in (1, 2))
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    return runs  # type: ignore[return-value]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", [*CASES, "exact-R5-N7"])
def test_two_failure_free_runs_are_bitwise_equal(case: str, tmp_path: Path, corpus: Path,
                                                 request: pytest.FixtureRequest) -> None:
    if case in CASES:
        replicas, n, steps, extra = CASES[case]
        a, b = _pair(tmp_path, corpus, replicas, n, steps, extra)
    else:
        n, steps, extra = 7, 12, ["--exact"]
        a, b = request.getfixturevalue("exact_pair")
    ra, rb = a.metrics(), b.metrics()
    assert [r["step"] for r in ra] == list(range(steps)) == [r["step"] for r in rb]
    assert all(r["microbatches"] == n for r in ra + rb)
    diff = [r["step"] for r, s in zip(ra, rb, strict=True) if r["loss"] != s["loss"]]
    assert not diff, f"losses differ first at step {diff[0]}"
    diff = [r["step"] for r, s in zip(ra, rb, strict=True) if r["digest"] != s["digest"]]
    assert not diff, f"parameter digests differ first at step {diff[0]}"
    assert ("sha" in ra[-1]["digest"]) == ("--exact" in extra)
    files = sorted(p.name for p in (a.out / "final").glob("replica*.pt"))
    assert files == sorted(p.name for p in (b.out / "final").glob("replica*.pt")) and files
    import torch

    for name in files:
        pa = torch.load(a.out / "final" / name, weights_only=True)
        pb = torch.load(b.out / "final" / name, weights_only=True)
        assert bitwise_equal(pa, pb), f"final parameters {name} differ"
    # Every replica of one run holds the same bits too (what the digest of each line stands for).
    first = torch.load(a.out / "final" / files[0], weights_only=True)
    if LAYOUT_FLAGS["tp"] != extra and LAYOUT_FLAGS["pp"] != extra and "--layout" not in extra:
        for name in files[1:]:
            assert bitwise_equal(first, torch.load(a.out / "final" / name, weights_only=True))
