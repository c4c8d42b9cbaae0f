"""`recover bench` end to end on a small run: outputs, trajectories, and the simulator's validation.

One real bench (reference, recover, ckpt-restart, shrink-batch; real processes and SIGKILLs) with
the smallest setup that still has every part: 2 replicas, one of them killed, a checkpoint restart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recover.app.train.metrics import read_metrics
from recover.sim.calibrate import load_calibration, predict_wall_times
from recover.testing.runs import Launch, max_rel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = ["--replicas", "2", "--steps", "20", "--seed", "0"]


@pytest.fixture(scope="module")
def bench(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench") / "b"
    run = Launch(out, *ARGS, data=corpus, command="bench").finish(540)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, run.stdout


def test_outputs_and_last_line(bench: tuple[Path, str]) -> None:
    out, stdout = bench
    for name in ("bench.md", "bench.png", "bench.json"):
        assert (out / name).stat().st_size > 0
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("effective_throughput_ratio=")
    assert float(last.split("=")[1]) > 0
    md = (out / "bench.md").read_text()
    for system in ("recover", "ckpt-restart", "shrink-batch"):
        assert f"| {system} |" in md


def test_trajectories(bench: tuple[Path, str]) -> None:
    out, _ = bench
    ref = read_metrics(out / "reference" / "metrics.jsonl")
    losses = {s: [r["loss"] for r in read_metrics(out / s / "metrics.jsonl")]
              for s in ("recover", "ckpt-restart", "shrink-batch")}
    ref_losses = [r["loss"] for r in ref]
    assert len(ref) == 20 and all(len(v) == 20 for v in losses.values())
    assert max_rel(losses["recover"], ref_losses) < 1e-5
    assert max_rel(losses["ckpt-restart"], ref_losses) < 1e-5  # constant N through the restart
    assert max_rel(losses["shrink-batch"], ref_losses) > 1e-4  # the batch shrank: it deviates
    shrink = read_metrics(out / "shrink-batch" / "metrics.jsonl")
    assert min(r["microbatches"] for r in shrink) == 4  # the survivor's own share of N = 8
    calib = json.loads((out / "bench.json").read_text())
    assert calib["replicas"] == 2 and len(calib["fault_steps"]) == 1
    runs = json.loads((out / "bench_runs.json").read_text())
    assert len(next(r for r in runs if r["name"] == "ckpt-restart")["attempts"]) == 2


def test_simulator_predicts_each_wall_time(bench: tuple[Path, str]) -> None:
    out, _ = bench
    calib = load_calibration(str(out / "bench.json"))
    pred = predict_wall_times(calib)
    errors = {s: abs(pred[s] - m) / m for s, m in calib["wall_s"].items()}
    assert set(errors) == {"recover", "ckpt-restart", "shrink-batch"}
    assert all(e < 0.15 for e in errors.values()), (errors, pred, calib["wall_s"])
