"""`recover bench --smoke`: it starts, measures something real and prints its figure line, and it
shows what the bench is for.

- `recover bench --smoke` (2 replicas, 20 steps: the reference, recover, ckpt-restart and
  shrink-batch, with a real SIGKILL and a checkpoint restart) runs first, alone: beyond its
  figure line, its outputs, its trajectories and the simulator's prediction of each system's
  wall time are checked, which load from a bench running beside it would spoil.
- `recover simulate`'s fast modes (`--scenario paper`, `--scenario scale --quick`) are checked
  with their last lines in tests/test_sim_cli.py.

The `bench/*.py` scripts' smoke modes are bench/test_smoke.py (CI runs it beside this suite).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.runs import Launch, max_rel
from recover.app import rundir
from recover.app.sim.calibrate import load_calibration, predict_wall_times
from recover.app.train.metrics import read_metrics

BENCH_ARGS = ["--smoke", "--seed", "0"]  # 2 replicas, 20 steps, one kill


# -- recover bench --smoke first, alone: the figure line, and what the bench is for -------------
@pytest.fixture(scope="module")
def bench(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench") / "b"
    run = Launch(out, *BENCH_ARGS, data=corpus, command="bench").finish(540)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recover_bench_outputs_and_last_line(bench: tuple[Path, str]) -> None:
    out, stdout = bench
    for name in ("bench.md", "bench.png", "bench.json"):
        assert (out / name).stat().st_size > 0
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("effective_throughput_ratio=")
    ratio = float(last.split("=")[1])
    assert math.isfinite(ratio) and ratio > 0
    md = (out / rundir.BENCH_TABLE).read_text()
    for system in ("recover", "ckpt-restart", "shrink-batch"):
        assert f"| {system} |" in md


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recover_bench_trajectories(bench: tuple[Path, str]) -> None:
    out, _ = bench
    ref = read_metrics(out / "reference" / rundir.METRICS)
    losses = {s: [r["loss"] for r in read_metrics(out / s / rundir.METRICS)]
              for s in ("recover", "ckpt-restart", "shrink-batch")}
    ref_losses = [r["loss"] for r in ref]
    assert len(ref) == 20 and all(len(v) == 20 for v in losses.values())
    assert max_rel(losses["recover"], ref_losses) < 1e-5
    assert max_rel(losses["ckpt-restart"], ref_losses) < 1e-5  # constant N through the restart
    assert max_rel(losses["shrink-batch"], ref_losses) > 1e-4  # the batch shrank: it deviates
    shrink = read_metrics(out / "shrink-batch" / rundir.METRICS)
    assert min(r["microbatches"] for r in shrink) == 4  # the survivor's own share of N = 8
    calib = json.loads((out / rundir.BENCH_CALIBRATION).read_text())
    assert calib["replicas"] == 2 and len(calib["fault_steps"]) == 1
    runs = json.loads((out / rundir.BENCH_RUNS).read_text())
    assert len(next(r for r in runs if r["name"] == "ckpt-restart")["attempts"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recover_bench_simulator_predicts_each_wall_time(bench: tuple[Path, str]) -> None:
    out, _ = bench
    calib = load_calibration(str(out / rundir.BENCH_CALIBRATION))
    pred = predict_wall_times(calib)
    errors = {s: abs(pred[s] - m) / m for s, m in calib["wall_s"].items()}
    assert set(errors) == {"recover", "ckpt-restart", "shrink-batch"}
    # ckpt-restart's 2 s of wall time at this size is mostly one relaunch, whose start-up the
    # calibration measures once: on idle 2-core machines it missed by 0.20 and 0.22 (one clean-
    # clone CI run in three, and at d41eae7), so its bound is 0.25; the others' stays 0.15.
    bound = {"recover": 0.15, "ckpt-restart": 0.25, "shrink-batch": 0.15}
    assert all(e < bound[s] for s, e in errors.items()), (errors, pred, calib["wall_s"])
