"""Smoke test of `bench/scale.py`'s analysis helpers on hand-made logs (no processes: the
benchmark itself is not a test). Each expected value is worked out by hand in the comments."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import scale  # noqa: E402


def step(t: int, commit: float, reduce_end: float, ops: int = 2, waits: int = 1, gen: int = 0,
         attempts: int = 1, cpu: float = 0.001) -> dict:
    return {"step": t, "gen": gen, "attempts": attempts, "t_commit": commit, "ops": ops,
            "waits": waits, "control_cpu": cpu,
            "reduces": [[gen, reduce_end - 0.01, reduce_end, True, 0.0, 0.0, 0.01, 0.0]],
            "after": [reduce_end], "computes": []}


def test_failure_free_takes_the_last_rank_of_each_step() -> None:
    logs = {
        (0, 0): [step(0, 9.0, 8.0), step(1, 10.10, 10.00, ops=3, waits=0, cpu=0.004),
                 step(2, 11.20, 11.00)],
        (1, 0): [step(0, 9.0, 8.0), step(1, 10.12, 10.05), step(2, 11.23, 11.10, ops=1,
                                                                  waits=1, cpu=0.002)],
    }
    ff = scale.failure_free(logs, 1, 3)  # step 0 is warm-up
    assert ff["steps"] == 2
    # step 1: last commit 10.12 - last reduce end 10.05; step 2: 11.23 - 11.10
    assert ff["control_s"] == pytest.approx((0.07 + 0.13) / 2)
    assert ff["store_ops"] == pytest.approx(3.0)  # max over ranks of ops + waits, each step
    assert ff["engine_ops"] == pytest.approx(2.5)  # max(3, 2) and max(2, 1)
    assert ff["period_s"] == pytest.approx(1.11)
    assert ff["control_cpu_s"] == pytest.approx((0.004 + 0.002) / 2)  # max over ranks, median
    with pytest.raises(ValueError):
        scale.failure_free({k: [s for s in v if s["step"] == 0] for k, v in logs.items()}, 1, 3)


def test_breakdown_follows_the_last_survivor() -> None:
    t_kill, t_gen = 100.0, 100.05
    fail = [0, 99.99, 100.02, "connection reset", 0.0, 0.0, 0.0, 0.0]
    a = {"step": 7, "gen": 1, "attempts": 2, "t_commit": 100.30, "ops": 3, "waits": 2,
         "reduces": [fail, [1, 100.10, 100.25, True, 0.02, 0.03, 0.09, 0.004]],
         "after": [100.08, 100.25], "computes": [[100.06, 100.09]]}
    b = {"step": 7, "gen": 1, "attempts": 2, "t_commit": 100.28, "ops": 3, "waits": 2,
         "reduces": [[0, 99.99, 100.051, "newer generation", 0.0, 0.0, 0.0, 0.0],
                     [1, 100.07, 100.25, True, 0.06, 0.04, 0.07, 0.003]],
         "after": [100.052, 100.25], "computes": []}
    bd = scale.breakdown({(0, 0): [a], (2, 0): [b]}, t_kill, t_gen, 0)
    assert bd["detect"] == pytest.approx(0.05)
    # the last to start is (0, 0) at 100.10; it recomputed 100.06..100.09 after the generation
    assert bd["recomp"] == pytest.approx(0.03)
    assert bd["agree"] == pytest.approx(0.10 - 0.05 - 0.03)
    assert bd["teardown"] == pytest.approx(100.08 - t_gen)  # the part after the generation
    assert bd["rebuild"] == pytest.approx(0.05)
    assert bd["rebuild_cpu"] == pytest.approx(0.004)
    assert bd["reduce"] == pytest.approx(0.09)
    assert bd["total"] == pytest.approx(0.30)
    assert bd["raised"] == 2
    assert sum(bd[p] for p in scale.PARTS) == pytest.approx(bd["total"])
    assert bd["agree_med"] == pytest.approx((0.02 + 0.02) / 2)  # (2, 0): 100.07 - t_gen


def test_curve_keeps_the_simulators_schema() -> None:
    row = {"ranks": 4, "replicas": 4, "positions": 1, "store_ops": 3.0, "control_s": 0.001,
           "control_cpu_s": 0.0005, "detect": 0.04, "agree": 0.01, "rebuild": 0.005,
           "rebuild_cpu": 0.001, "store_cpu": 0.01, "reduce": 0.002, "recovery_ops": 2.0,
           "main_reqs": 3.5, "shard_reqs": 12.0, "rank_main_reqs": 2.5, "coord_reqs": 4.0,
           "store_ops_mean": 2.5, "shard_bytes": 1500.4, "chain_reqs": 1.333}
    data = scale.curve([{**row, "ranks": 16, "replicas": 16}, row,
                        {**row, "positions": 8, "ranks": 64, "replicas": 8}], "here", 2)
    assert list(data) == ["source", "ranks", "group", "store_ops_per_rank_step",
                          "control_plane_s", "control_plane_cpu_s", "detect_s", "agree_s",
                          "rebuild_s", "rebuild_cpu_s", "store_cpu_s",
                          "recovery_store_ops_per_rank", "reduce_s",
                          "failure_main_requests_per_rank",
                          "failure_main_chain_requests_per_rank", "failure_coordinator_requests",
                          "failure_shard_requests_per_member",
                          "failure_shard_bytes_per_member", "store_shards"]
    assert data["failure_shard_bytes_per_member"] == [1500, 1500]
    assert data["store_ops_per_rank_step"] == [2.5, 2.5]  # the mean rank's
    assert data["ranks"] == [4, 16]  # P = 1 only, sorted by ranks
    assert data["group"] == [4, 16]  # each rebuilt group: one member per replica


def counted(t: int, commit: float, main: int, shard: int, gen: int = 0, cpu: float = 0.0,
            marks: tuple = ()) -> dict:
    """A step record with cumulative request counts and its commit's CPU clock."""
    return {"step": t, "gen": gen, "t_commit": commit, "main_reqs": main, "shard_reqs": shard,
            "shard_bytes": 100 * shard, "cpu_commit": cpu, "marks": [list(m) for m in marks]}


def test_failure_requests_count_the_window_less_the_new_memberships_rate() -> None:
    # Killed at 10.5 during step 3; the failure-free steps cost (main, shard) = (2, 4) a step
    # before the kill, and (3, 4) after it (this rank now also deletes old keys).
    def rank(extra_main: int, extra_shard: int) -> list[dict]:
        recs = [counted(t, 10.0 + t * 0.1, 2 * t, 4 * t) for t in range(3)]  # steps 0..2
        main, shard = 4 + extra_main, 8 + extra_shard
        for t in range(3, 3 + 1 + scale.TAIL + scale.AFTER):  # step 3 committed in gen 1
            main, shard = main + 3, shard + 4
            recs.append(counted(t, 11.0 + t * 0.1, main, shard, gen=1))
        return recs

    steps = {(0, 0): rank(5, 20), (2, 0): rank(1, 20)}
    for recs in steps.values():  # the same requests, all on one key kind
        for r in recs:
            r["main_kinds"] = {"step/#/chain/#": r["main_reqs"]}
    got = scale.failure_requests(steps, 10.5, 0, coord=4.0)
    assert got["main_kinds"] == {"step/#/chain/#": pytest.approx((5 + 1) / 2)}
    assert got["chain_reqs"] == pytest.approx((5 + 1) / 2)  # the chain's share, per replica
    # each rank's window: steps 3..3+TAIL, its extra over 3 a step; the coordinator's 4 too
    assert got["main_reqs"] == pytest.approx((5 + 1 + 4) / 2)
    assert got["rank_main_reqs"] == pytest.approx((5 + 1) / 2) and got["coord_reqs"] == 4.0
    assert got["main_max"] == pytest.approx(5)
    assert got["shard_reqs"] == pytest.approx(20)
    assert got["shard_bytes"] == pytest.approx(2000)  # counted like the requests
    with pytest.raises(ValueError):  # no steps after the window: no rate to subtract
        scale.failure_requests({k: v[:-1] for k, v in steps.items()}, 10.5, 0, coord=0.0)


def test_recovery_cpu_runs_from_the_last_reading_before_the_kill_to_the_first_new_commit() -> None:
    # Killed at 10.5. a: its last reading before is at 10.2 (0.50 s of CPU; the one at 10.6 is
    # after), its first commit in generation 1 at 0.80; b: its commit at 10.4 (0.60), then 0.70.
    a = [counted(0, 10.0, 0, 0, cpu=0.40, marks=((10.2, 0.50), (10.6, 0.55))),
         counted(1, 11.0, 0, 0, gen=1, cpu=0.80), counted(2, 12.0, 0, 0, gen=1, cpu=0.90)]
    b = [counted(0, 10.4, 0, 0, cpu=0.60), counted(1, 10.9, 0, 0, gen=1, cpu=0.70)]
    assert scale.recovery_cpu({(0, 0): a, (1, 0): b}, 10.5, 0) == pytest.approx(0.30)
    with pytest.raises(ValueError):  # nothing read before the kill
        scale.recovery_cpu({(0, 0): a}, 9.0, 0)
