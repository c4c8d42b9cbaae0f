"""Tests of the cluster simulator (`recover.app.sim`): policies, accounting, faults, calibration."""

from __future__ import annotations

import ast
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.sim import calib
from recover.app.sim import (
    SimParams,
    build_schedule,
    predict_wall_times,
    simulate,
    young_daly_interval_s,
    young_daly_steps,
)
from recover.app.sim.calibrate import calib_params, load_calibration
from recover.app.sim.faults import load_trace
from recover.app.sim.job import Job, replica_quotas
from recover.errors import ConfigError

# 4 replicas, N = 8 (2 per replica), 1 s steps of which 0.2 s all-reduce -> 0.4 s per microbatch.
SMALL = dict(
    gpus=4,
    gpus_per_replica=1,
    microbatches=8,
    step_time_s=1.0,
    allreduce_s=0.2,
    detect_s=0.1,
    rebuild_s=0.05,
    ckpt_cost_s=0.3,
    restart_cost_s=2.0,
    per_gpu_mttf_h=None,
    total_steps=10,
)


def test_young_daly_formula() -> None:
    assert young_daly_interval_s(60.0, 3600.0) == pytest.approx(math.sqrt(2 * 60 * 3600))
    assert young_daly_steps(60.0, 3600.0, 5.0) == round(math.sqrt(2 * 60 * 3600) / 5)
    assert young_daly_steps(60.0, 0.01, 5.0) == 1  # never below one step
    assert young_daly_steps(60.0, math.inf, 5.0) > 10**8  # no faults: never checkpoint


def test_deterministic_with_seed() -> None:
    p = SimParams(per_gpu_mttf_h=300.0, total_steps=3000, seed=7)
    a, b = simulate(p), simulate(SimParams(per_gpu_mttf_h=300.0, total_steps=3000, seed=7))
    for name in a:
        assert a[name].series == b[name].series
        assert a[name].wall_s == b[name].wall_s
    c = simulate(SimParams(per_gpu_mttf_h=300.0, total_steps=3000, seed=8))
    assert c["recover"].fault_times_s != a["recover"].fault_times_s


def test_no_failures_equal_except_checkpoints() -> None:
    p = SimParams(per_gpu_mttf_h=None, total_steps=1000, ckpt_interval_steps=100)
    res = simulate(p)
    assert res["recover"].wall_s == pytest.approx(1000 * p.step_time_s)
    assert res["shrink-batch"].wall_s == pytest.approx(1000 * p.step_time_s)
    assert res["ckpt-restart"].wall_s == pytest.approx(1000 * p.step_time_s + 10 * p.ckpt_cost_s)
    for r in res.values():
        assert r.committed_mb == r.processed_mb == 1000 * p.n_microbatches
        assert r.finished


def test_exact_costs_of_one_fault() -> None:
    """One replica of 4 killed mid-compute of step 0 (t = 0.4 s): each policy's documented cost."""
    res = simulate(SimParams(**SMALL, fault_steps=[0], ckpt_interval_steps=5))
    # recover: max(compute end 0.8, 0.4 + detect) + rebuild + ceil(2/3) * 0.4 + all-reduce, then
    # 9 steps with ceil(8/3) = 3 microbatches on the busiest replica (1.4 s).
    assert res["recover"].wall_s == pytest.approx(0.8 + 0.05 + 0.4 + 0.2 + 9 * 1.4)
    assert res["recover"].committed_mb == 80
    # ckpt-restart: fault at 0.4, restart until 0.4 + 0.1 + 2.0, 10 steps of 1.4 s, 2 checkpoints.
    assert res["ckpt-restart"].wall_s == pytest.approx(2.5 + 10 * 1.4 + 2 * 0.3)
    assert res["ckpt-restart"].restarts == 1
    # shrink-batch: step discarded, resume at max(0.8, 0.5) + rebuild, 10 steps of 1 s with 6 mb.
    assert res["shrink-batch"].wall_s == pytest.approx(0.85 + 10 * 1.0)
    assert res["shrink-batch"].committed_mb == 60
    assert res["shrink-batch"].discarded_steps == 1


def test_measured_step_times_and_restart_detection() -> None:
    """Measured step time with 3 replicas (1.2 s) replaces ceil(8/3) x 0.4 s; ckpt-restart's own
    detection time replaces detect_s in its restart."""
    res = simulate(
        SimParams(
            **SMALL,
            fault_steps=[0],
            ckpt_interval_steps=5,
            step_time_by_replicas={3: 1.2},
            restart_detect_s=0.5,
        )
    )
    redo = (1.2 - 0.2) / 3  # one microbatch with 3 replicas running
    assert res["recover"].wall_s == pytest.approx(0.8 + 0.05 + redo + 0.2 + 9 * 1.2)
    assert res["ckpt-restart"].wall_s == pytest.approx(0.4 + 0.5 + 2.0 + 10 * 1.2 + 2 * 0.3)
    # shrink-batch: 3 survivors of quota 2 run at the 3-replica microbatch time.
    assert res["shrink-batch"].wall_s == pytest.approx(0.85 + 10 * (1.2 - redo))


def test_recover_never_loses_work() -> None:
    res = simulate(SimParams(per_gpu_mttf_h=200.0, total_steps=5000, seed=3))["recover"]
    assert res.replica_losses > 0
    assert res.committed_mb == res.steps * res.microbatches == 5000 * 256
    committed = [row[2] for row in res.series]
    assert committed == sorted(committed)
    assert res.processed_mb >= res.committed_mb  # recomputed lost quotas only
    assert res.mean_batch_frac == 1.0


def test_ckpt_restart_loses_work_on_faults() -> None:
    res = simulate(SimParams(per_gpu_mttf_h=200.0, total_steps=5000, seed=3))["ckpt-restart"]
    assert res.restarts > 0 and res.checkpoints > 0
    assert res.processed_mb > res.committed_mb == res.steps * res.microbatches
    committed = [row[2] for row in res.series]
    assert any(b < a for a, b in zip(committed, committed[1:], strict=False))  # a rollback


def test_shrink_batch_batch_shrinks() -> None:
    res = simulate(SimParams(per_gpu_mttf_h=200.0, total_steps=5000, seed=3))["shrink-batch"]
    assert res.replica_losses > 0
    assert 1 <= res.discarded_steps <= res.replica_losses
    assert res.min_batch_mb < res.microbatches
    assert res.mean_batch_frac < 1.0
    assert res.committed_mb < res.steps * res.microbatches


def test_same_failures_same_gpu_hours() -> None:
    p = SimParams(fault_times_h=[0.5, 1.0, 1.7], total_steps=None, budget_h=3.0)
    res = simulate(p)
    for r in res.values():
        assert r.fault_times_s == [1800.0, 3600.0, 1.7 * 3600]
        assert r.gpu_hours == pytest.approx(512 * 3 - 8 * (2.5 + 2.0 + 1.3))


def test_bulk_advance_matches_stepwise(monkeypatch: pytest.MonkeyPatch) -> None:
    p = SimParams(
        per_gpu_mttf_h=300.0,
        total_steps=None,
        budget_h=20.0,
        spares=4,
        replace_delay_s=300.0,
        seed=2,
    )
    fast = simulate(p)
    monkeypatch.setattr(Job, "free_steps", lambda self, st: 0)
    slow = simulate(p)
    for name in fast:
        a, b = fast[name], slow[name]
        assert (a.steps, a.committed_mb, a.restarts, a.checkpoints) == (
            b.steps,
            b.committed_mb,
            b.restarts,
            b.checkpoints,
        )
        assert a.wall_s == pytest.approx(b.wall_s)


@settings(max_examples=60, deadline=None)
@given(active=st.sets(st.integers(0, 40), min_size=1, max_size=12), n=st.integers(0, 200))
def test_replica_quotas_even_and_complete(active: set[int], n: int) -> None:
    q = replica_quotas(list(active), n)
    assert set(q) == active and sum(q.values()) == n
    assert max(q.values()) - min(q.values()) <= 1
    order = sorted(active)  # the extra microbatches go to the lowest slots
    assert [q[s] for s in order] == sorted(q.values(), reverse=True)


def _sim_imports(module: str) -> set[str]:
    """The `recover.app.sim` modules that `module` imports anywhere (functions included)."""
    import recover.app.sim

    tree = ast.parse((Path(recover.app.sim.__file__).parent / f"{module}.py").read_text())
    return {
        node.module.removeprefix("recover.app.sim.")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recover.app.sim.")
    }


def test_sim_imports_run_one_way() -> None:
    # engine -> policies -> job: a lazy import inside a function would be a cycle in disguise.
    assert "engine" not in _sim_imports("policies") | _sim_imports("job")
    assert "policies" not in _sim_imports("job")
    assert {"policies", "job"} <= _sim_imports("engine")


def test_spares_restore_speed() -> None:
    kw = dict(fault_times_h=[0.1, 0.2], total_steps=3000)
    bare = simulate(SimParams(**kw))["recover"]
    spared = simulate(SimParams(**kw, spares=2, replace_delay_s=60.0))["recover"]
    assert spared.wall_s < bare.wall_s
    assert spared.replica_losses == bare.replica_losses == 2


def test_exponential_failures_rate() -> None:
    p = SimParams(per_gpu_mttf_h=100.0, seed=1)
    sched = build_schedule(p)
    within = [f for f in sched.timed if f.time_s < 10 * 3600]
    expected = 64 * (1 - math.exp(-8 * 10 / 100))  # slots with a GPU failing in 10 h
    assert 0.6 * expected < len(within) < 1.4 * expected
    assert len({f.slot for f in sched.timed}) == len(sched.timed)  # a slot dies once


def test_trace_formats(tmp_path) -> None:
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("# failures\ntime_h,gpu\n0.5,17\n1.5\n")
    assert load_trace(str(csv_path)) == ([0.5, 1.5], [17, None])
    js = tmp_path / "t.json"
    js.write_text(json.dumps({"failures": [{"time_h": 2, "gpu": 9}, {"time_h": 1}]}))
    assert load_trace(str(js)) == ([2.0, 1.0], [9, None])
    js.write_text("[0.25, 0.75]")
    sched = build_schedule(SimParams(failure_trace=str(js), total_steps=100))
    assert [f.time_s for f in sched.timed] == [900.0, 2700.0]
    sched = build_schedule(SimParams(failure_trace=str(csv_path), total_steps=100))
    assert sched.timed[0].slot == 17 // 8
    for bad in ("[1, -2]", '{"failures": 3}', '[{"gpu": 1}]', "[1,"):
        js.write_text(bad)
        with pytest.raises(ConfigError):
            load_trace(str(js))
    with pytest.raises(ConfigError):
        SimParams(failure_trace=str(tmp_path / "missing.csv")).validate()


@pytest.mark.parametrize(
    "kw",
    [
        dict(gpus=10, gpus_per_replica=4),
        dict(step_time_s=-1.0),
        dict(allreduce_s=9.0),
        dict(total_steps=None, budget_h=None),
        dict(min_replicas=100),
        dict(per_gpu_mttf_h=0.0),
    ],
)
def test_invalid_params(kw: dict) -> None:
    with pytest.raises(ConfigError):
        SimParams(**kw).validate()


def test_predict_wall_times_zero_faults() -> None:
    pred = predict_wall_times(calib())
    assert pred["recover"] == pytest.approx(4.5 + 40 * 0.2)
    assert pred["shrink-batch"] == pytest.approx(4.5 + 40 * 0.2)
    assert pred["ckpt-restart"] == pytest.approx(4.5 + 40 * 0.2 + 4 * 0.3)


def test_predict_wall_times_with_faults() -> None:
    pred = predict_wall_times(calib(fault_steps=[12, 30]))
    base = 4.5 + 40 * 0.2
    assert base < pred["recover"] < pred["ckpt-restart"]
    # ckpt-restart pays two restarts and redoes steps 10 and 11 (its checkpoints: steps 10, 20, 30).
    assert pred["ckpt-restart"] >= base + 2 * (6.0 + 1.0) + 2 * 0.2
    assert base < pred["shrink-batch"] < pred["ckpt-restart"]


def test_calibration_optional_keys() -> None:
    p = calib_params(calib(step_time_by_replicas_s={"3": 0.25}, restart_detect_s=0.1))
    assert p.step_time_by_replicas == {3: 0.25}
    assert p.restart_detect_s == 0.1
    pred = predict_wall_times(calib(fault_steps=[5], step_time_by_replicas_s={"3": 0.25}))
    assert pred["recover"] > 4.5 + 5 * 0.2 + 35 * 0.25


def test_calibration_errors(tmp_path) -> None:
    with pytest.raises(ConfigError):
        calib_params({k: v for k, v in calib().items() if k != "steps"})
    with pytest.raises(ConfigError):
        calib_params(calib(restart_cost_s=-1))
    with pytest.raises(ConfigError):
        calib_params(calib(fault_steps=[1.5]))
    with pytest.raises(ConfigError):
        calib_params(calib(wall_s={"nonsense": 1.0}))
    with pytest.raises(ConfigError):
        calib_params(calib(step_time_by_replicas_s={"three": 0.2}))
    with pytest.raises(ConfigError):
        calib_params(calib(step_time_by_replicas_s={"9": 0.2}))  # more than the 4 replicas
    bad = tmp_path / "bench.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError):
        load_calibration(str(bad))
    with pytest.raises(ConfigError):
        load_calibration(str(tmp_path / "absent.json"))


@settings(max_examples=40, deadline=None)
@given(
    replicas=st.integers(2, 12),
    per=st.integers(1, 5),
    faults=st.lists(st.floats(0.0, 2.0), max_size=6),
    spares=st.integers(0, 2),
    ckpt=st.integers(1, 50),
)
def test_invariants_hold(replicas: int, per: int, faults: list, spares: int, ckpt: int) -> None:
    p = SimParams(
        gpus=replicas * 2,
        gpus_per_replica=2,
        microbatches=replicas * per + 1,
        step_time_s=2.0,
        allreduce_s=0.1,
        fault_times_h=sorted(faults),
        spares=spares,
        replace_delay_s=120.0,
        ckpt_interval_steps=ckpt,
        total_steps=None,
        budget_h=2.5,
    )
    res = simulate(p)
    for name, r in res.items():
        committed = [row[2] for row in r.series]
        if name != "ckpt-restart":
            assert committed == sorted(committed)
        if name != "shrink-batch":
            assert r.committed_mb == r.steps * p.microbatches
        assert r.committed_mb <= r.processed_mb
        assert r.gpu_hours <= (p.gpus + spares * 2) * r.wall_s / 3600 + 1e-9
        if name != "shrink-batch":  # its survivors may hold smaller quotas than the busiest
            assert r.wall_s >= r.steps * p.step_time_s - 1e-6


def test_weak_scaling_keeps_every_replica_busy() -> None:
    assert SimParams().n_microbatches == 256  # 512 GPUs: the paper's N, unchanged
    big = SimParams(gpus=100_000)
    assert big.n_microbatches >= big.replicas == 12_500
    assert big.mb_time_s == pytest.approx(SimParams().mb_time_s)  # same step, same microbatch
    assert SimParams(gpus=100_000, microbatches=256).n_microbatches == 256  # given: kept
    with pytest.raises(ConfigError):
        SimParams(microbatches_per_replica=0).validate()


def test_control_plane_is_charged_per_step_to_recover_and_shrink_batch() -> None:
    p = SimParams(per_gpu_mttf_h=None, total_steps=100, control_plane_s=0.25)
    res = simulate(p)
    assert res["recover"].wall_s == pytest.approx(100 * 5.25)
    assert res["shrink-batch"].wall_s == pytest.approx(100 * 5.25)
    assert res["ckpt-restart"].wall_s == pytest.approx(100 * 5.0)  # never checkpoints here


def test_curve_fits_and_checks(tmp_path) -> None:
    from recover.app.sim.curve import COLUMNS, fit, load_curve

    lin = fit([4, 16, 64], [1.0, 4.0, 16.0], "linear")
    assert (lin.a, lin.b) == pytest.approx((0.0, 0.25)) and lin(1024) == pytest.approx(256.0)
    lg = fit([4, 16, 64], [2.0, 4.0, 6.0], "log2")
    assert lg(1024) == pytest.approx(10.0)
    falling = fit([4, 16], [3.0, 1.0], "linear")  # noise, not a cost that shrinks with size
    assert falling.b == 0.0 and falling(10**6) == pytest.approx(2.0)
    shipped = load_curve()
    assert shipped.source and set(COLUMNS) <= set(shipped.values)
    doc = {"source": "s", "ranks": [4, 8], **{c: [0.1, 0.2] for c in COLUMNS}}
    for broken in (
        {k: v for k, v in doc.items() if k != "rebuild_s"},
        {**doc, "agree_s": [0.1]},
        {**doc, "detect_s": [0.1, -1.0]},
        {**doc, "ranks": [8, 4]},
    ):
        path = tmp_path / "c.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(ConfigError):
            load_curve(path)
    with pytest.raises(ConfigError):
        load_curve(tmp_path / "absent.json")


def test_scale_models() -> None:
    from recover.app.sim.scale import RESTART_ANCHORS, restart_fit, target_weights

    for gpus, seconds, _ in RESTART_ANCHORS:
        assert restart_fit()(gpus) == pytest.approx(seconds)
    w, how = target_weights([65536, 131072, 1024])
    assert w[65536] + w[131072] == pytest.approx(1.0) and w[131072] > 0.5
    assert "interpolated" in how
    assert target_weights([100_000, 131072])[0] == {100_000: 1.0}
    assert target_weights([1024, 2048])[0] == {2048: 1.0}  # nearest when not bracketed


def test_rebuild_is_read_at_the_group_size_and_the_reduce_is_the_step_models(tmp_path) -> None:
    """A failure rebuilds cross-replica groups of R = GPUs / GPUs-per-replica members: the
    communicator's columns are fitted and read at R, the protocol's at the job's ranks; the
    redone reduce is the policy's all-reduce, not the curve's loopback reduce."""
    from recover.app.sim.curve import COLUMNS, load_curve, x_of
    from recover.app.sim.scale import ScaleSpec, recover_pause_s, scale_base, size_params

    doc = {"source": "s", "ranks": [64, 128], "group": [8, 16],
           **{c: [0.0, 0.0] for c in COLUMNS}}
    doc["rebuild_s"] = [8.0, 16.0]  # 1 s per member, wall clock
    doc["rebuild_cpu_s"] = [0.08, 0.16]  # 10 ms per member of CPU
    doc["agree_s"] = [0.1, 0.1]
    doc["reduce_s"] = [50.0, 100.0]  # must not be charged
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    curve = load_curve(path)
    assert x_of("rebuild_s") == "group" and x_of("agree_s") == "ranks"
    fits = curve.fits()
    assert fits["rebuild_s"](16) == pytest.approx(16.0)  # a line through (8, 8) and (16, 16)
    assert recover_pause_s(fits, 100_000, 781) == pytest.approx(0.1 + 7.81)
    assert recover_pause_s(fits, 100_000, 781, "wall") == pytest.approx(0.1 + 781.0)
    p = size_params(scale_base(), 131072, 0, ScaleSpec(curve=curve))
    assert p.replicas == 1024 and p.rebuild_s == pytest.approx(0.1 + 10.24)
    path.write_text(json.dumps({**doc, "group": [8]}))
    with pytest.raises(ConfigError):
        load_curve(path)


def test_control_plane_charges_rank_cpu_and_the_store_servers_serial_work(tmp_path) -> None:
    """Per step, "cpu" (default) charges a rank's own control-plane CPU plus the serial work
    of the store servers at the curve's CPU per request: with --store-shards = G / 1,024, a
    shard's ranks' 2 requests each then 2 per shard on the main store; "one-store" puts every
    request on one server; "wall" (and any curve without the two measurements) charges the
    measured wall clock."""
    from recover.app.sim.curve import COLUMNS, load_curve
    from recover.app.sim.scale import (
        ScaleSpec,
        control_plane_s,
        scale_base,
        shards_for,
        size_params,
        store_serial_s,
    )

    doc = {"source": "s", "ranks": [4, 64], **{c: [0.0, 0.0] for c in COLUMNS}}
    doc["store_ops_per_rank_step"] = [2.0, 2.0]
    doc["control_plane_s"] = [0.5, 0.5]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    old = ScaleSpec(curve=load_curve(path))
    assert control_plane_s(old, old.fits(), 100_000) == pytest.approx(0.5)  # wall: all it has
    assert store_serial_s(old, old.fits(), 100_000) == 0.0
    path.write_text(json.dumps({**doc, "store_request_cpu_s": 1e-5,
                                "control_plane_cpu_s": [0.001, 0.001]}))
    curve = load_curve(path)
    assert shards_for(1024) == 0 and shards_for(2048) == 2 and shards_for(100_000) == 98
    assert shards_for(10**7) == 256
    cpu, one, wall = (ScaleSpec(curve=curve, control=m, speaker=False)
                      for m in ("cpu", "one-store", "wall"))
    fits = cpu.fits()
    per_shard = math.ceil(100_000 / 98)
    assert store_serial_s(cpu, fits, 100_000) == pytest.approx((2 * per_shard + 1 + 98) * 1e-5)
    assert store_serial_s(one, fits, 100_000) == pytest.approx(2.0)  # 2 x 1e5 x 10 us
    assert store_serial_s(cpu, fits, 1024) == pytest.approx(2 * 1024 * 1e-5)  # one store
    assert control_plane_s(wall, fits, 100_000) == pytest.approx(0.5)
    p = size_params(scale_base(), 131072, 0, cpu)
    assert p.control_plane_s == pytest.approx(0.001 + (2 * 1024 + 1 + 128) * 1e-5)
    # A speaker per replica (the default): a shard serves its replicas' speakers (128 GPUs
    # each: 781 replicas at 100,000 GPUs, 8 per shard), not its 1,021 ranks.
    speaker = ScaleSpec(curve=curve)
    assert speaker.speaker
    assert store_serial_s(speaker, fits, 100_000) == pytest.approx(
        (2 * math.ceil(781 / 98) + 1 + 98) * 1e-5)
    assert store_serial_s(replace(speaker, control="one-store"), fits, 100_000) == \
        pytest.approx(2 * 781 * 1e-5)
    path.write_text(json.dumps({**doc, "store_request_cpu_s": -1}))
    with pytest.raises(ConfigError):
        load_curve(path)


def test_a_failure_charges_the_main_store_its_ranks_recovery_requests(tmp_path) -> None:
    """Per failure, every rank's extra round trips of the recovery step (the curve's
    recovery_store_ops_per_rank) are served by the main store in series, on top of the pause;
    not charged without the measurement or with the wall-clock control plane."""
    from recover.app.sim.curve import COLUMNS, load_curve
    from recover.app.sim.scale import ScaleSpec, recovery_store_s, scale_base, size_params

    doc = {"source": "s", "ranks": [4, 64], **{c: [0.0, 0.0] for c in COLUMNS},
           "store_request_cpu_s": 1e-5, "control_plane_cpu_s": [0.001, 0.001]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    without = ScaleSpec(curve=load_curve(path))
    assert recovery_store_s(without, without.fits(), 100_000) == 0.0
    path.write_text(json.dumps({**doc, "recovery_store_ops_per_rank": [2.0, 2.0]}))
    spec = ScaleSpec(curve=load_curve(path))
    assert recovery_store_s(spec, spec.fits(), 100_000) == pytest.approx(2.0)  # 2 x 1e5 x 10 us
    wall = ScaleSpec(curve=spec.curve, control="wall")
    assert recovery_store_s(wall, wall.fits(), 100_000) == 0.0
    base = size_params(scale_base(), 131072, 0, without).rebuild_s
    assert size_params(scale_base(), 131072, 0, spec).rebuild_s == pytest.approx(
        base + 2 * 131072 * 1e-5)


def test_a_failure_charges_every_main_store_request_and_the_rendezvous(tmp_path) -> None:
    """With the curve's failure_main_requests_per_rank (every request a failure makes of the
    main store, per one-rank replica) the main store's charge is that x G / 128 replicas (each
    replica's speaker asks it), x G ranks without a speaker; the rebuild's rendezvous
    (failure_shard_requests_per_member per member, log2 in
    the group, at the CPU per request, plus failure_shard_bytes_per_member, linear, at the CPU
    per byte) is charged on the busiest store server: with S = G / 1,024 shards, position
    p's group meets on shard p mod S, so ceil(P / S) groups; with one store, all P."""
    from recover.app.sim.curve import COLUMNS, load_curve
    from recover.app.sim.scale import (
        ScaleSpec,
        recovery_store_s,
        rendezvous_groups,
        rendezvous_store_s,
        scale_base,
        shards_for,
        size_params,
    )

    doc = {"source": "s", "ranks": [4, 64], "group": [4, 64], **{c: [0.0, 0.0] for c in COLUMNS},
           "store_request_cpu_s": 1e-5, "control_plane_cpu_s": [0.001, 0.001],
           "recovery_store_ops_per_rank": [2.0, 2.0],
           "failure_main_requests_per_rank": [3.0, 3.0],
           "failure_coordinator_requests": [4.0, 4.0],
           "failure_shard_requests_per_member": [3.0, 3.0], "store_shards": 2,
           "failure_shard_bytes_per_member": [400.0, 10000.0], "store_byte_cpu_s": 1e-9}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    spec = ScaleSpec(curve=load_curve(path))
    fits = spec.fits()
    assert spec.curve.store_shards == 2
    assert fits["failure_shard_requests_per_member"](781) == pytest.approx(3.0)
    b = (10000 - 400) / (64 - 4)
    assert fits["failure_shard_bytes_per_member"](781) == pytest.approx(400 - 4 * b + b * 781)
    member = 3.0 * 1e-5 + (400 - 4 * b + b * 781) * 1e-9
    # Each of the 781 replicas' speakers asks the 3, and the coordinator 4 per failure; without
    # a speaker every rank asks all 3 (3 x 1e5 x 10 us).
    assert recovery_store_s(spec, fits, 100_000) == pytest.approx((3 * 781 + 4) * 1e-5)
    every = ScaleSpec(curve=spec.curve, speaker=False)
    assert recovery_store_s(every, every.fits(), 100_000) == pytest.approx(3.0 + 4e-5)
    path.write_text(json.dumps(doc))
    # 100,000 GPUs: 781 replicas of 128 positions over 98 shards: 2 groups on the busiest
    assert shards_for(100_000) == 98 and rendezvous_groups(spec, 100_000, 781) == 2
    assert rendezvous_store_s(spec, fits, 100_000, 781) == pytest.approx(2 * 781 * member)
    one = ScaleSpec(curve=spec.curve, control="one-store")
    assert rendezvous_groups(one, 100_000, 781) == 128
    assert rendezvous_store_s(one, fits, 100_000, 781) == pytest.approx(128 * 781 * member)
    wall = ScaleSpec(curve=spec.curve, control="wall")
    assert rendezvous_store_s(wall, fits, 100_000, 781) == 0.0
    p = size_params(scale_base(), 131072, 0, spec)
    bare = {**doc}
    for c in ("failure_main_requests_per_rank", "failure_shard_requests_per_member",
              "failure_coordinator_requests", "failure_shard_bytes_per_member"):
        bare.pop(c)
    path.write_text(json.dumps(bare))
    old = ScaleSpec(curve=load_curve(path))
    assert recovery_store_s(old, old.fits(), 100_000) == pytest.approx(2.0)  # the older column
    assert rendezvous_store_s(old, old.fits(), 100_000, 781) == 0.0
    assert p.rebuild_s == pytest.approx(size_params(scale_base(), 131072, 0, old).rebuild_s
                                        # per replica's speaker now, per rank before
                                        + (3.0 * 1024 - 2.0 * 131072) * 1e-5 + 4e-5
                                        + 1 * 1024 * (3.0 * 1e-5 + (400 - 4 * b
                                                                      + b * 1024) * 1e-9))
    path.write_text(json.dumps({**doc, "store_shards": -1}))
    with pytest.raises(ConfigError):
        load_curve(path)
