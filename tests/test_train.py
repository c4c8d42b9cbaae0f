"""The foundation of the invariant: a step's gradient is a function of its N ids, not of R.

Real multi-process runs of `recover train` (coordinator + replica processes, gloo).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.runs import (
    BASE,
    Launch,
    Run,
    bitwise_equal,
    max_rel,
    recover_train,
    rel_l2,
    two_free_ports,
)
from recover.app import rundir
from recover.app.status import read_status

pytestmark = pytest.mark.timeout(300)


def test_reference_run_outputs(ref4: Run) -> None:
    recs = ref4.metrics()
    assert [r["step"] for r in recs] == list(range(14))
    for r in recs:
        assert r["microbatches"] == 8 and r["live_replicas"] == 4 and r["generation"] == 0
        assert sum(r["quotas"].values()) == 8
        for k in ("loss", "lr", "grad_norm", "quotas", "step_time_s", "time_s"):
            assert k in r
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5, "the loss must fall"
    assert "val_loss" in recs[-1]
    assert (ref4.out / rundir.CONFIG).exists() and (ref4.out / rundir.CKPT / "latest").exists()
    # run_start is the base of time_s: every commit lies after the initial membership, and the
    # launcher's clock was read before it started the coordinator (bench/rejoin.py relies on it).
    t0 = float((ref4.out / rundir.RUN_START).read_text())
    events = [json.loads(line)
              for line in (ref4.out / rundir.COORDINATOR_LOG).read_text().splitlines()
              if line.startswith("{")]
    assert t0 <= events[0]["time"]
    gen0 = next(e for e in events if e["event"] == "generation")
    assert t0 + recs[0]["time_s"] >= gen0["time"]
    finals = ref4.finals()
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(bitwise_equal(finals[0], f) for f in finals.values()), "replicas diverged"
    # The status model of a failure-free finished run (recover status, /status, the report).
    model = read_status(ref4.out)
    assert (model["state"], model["committed"], model["step"]) == ("finished", 14, 13)
    assert model["faults"] == [] and model["recoveries"] == [] and model["generation"] == 0
    assert model["step_members"] == [0, 1, 2, 3] and model["loss"] == recs[-1]["loss"]
    assert {r["state"] for r in model["replica_states"]} == {"left cleanly"}


@pytest.mark.parametrize(("replicas", "forkserver"), [(2, "1"), (1, "0")])
def test_same_trajectory_for_any_replica_count(ref4: Run, corpus: Path, tmp_path: Path,
                                               replicas: int, forkserver: str) -> None:
    # RECOVER_FORKSERVER=0: the launcher starts its coordinator and replica as plain
    # subprocesses (a fresh Python each), the fallback where fork is unavailable. (A fork server
    # started as a fresh Python: test_baselines' abort_on_loss, launched in this process.)
    env = dict(os.environ, RECOVER_FORKSERVER=forkserver)
    run = recover_train(tmp_path / "run", *BASE, "--replicas", str(replicas),
                        "--dump-final-params", data=corpus, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(r["microbatches"] == 8 for r in run.metrics())
    assert max_rel(run.losses(), ref4.losses()) < 1e-5
    assert rel_l2(run.final(0), ref4.final(0)) < 1e-4


def test_uneven_quotas_match_single_replica(corpus: Path, tmp_path: Path) -> None:
    args = [*BASE, "--steps", "8", "--microbatches", "10", "--dump-final-params"]
    one = recover_train(tmp_path / "r1", *args, "--replicas", "1", data=corpus)
    four = recover_train(tmp_path / "r4", *args, "--replicas", "4", data=corpus)
    assert one.returncode == 0 and four.returncode == 0, four.stderr[-3000:]
    assert sorted(four.metrics()[0]["quotas"].values()) == [2, 2, 3, 3]
    assert all(r["microbatches"] == 10 for r in four.metrics())
    assert max_rel(four.losses(), one.losses()) < 1e-5
    assert rel_l2(four.final(0), one.final(0)) < 1e-4


def test_resume_matches_uninterrupted(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = recover_train(out, *BASE, "--replicas", "4", "--stop-at", "7", data=corpus)
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(first.metrics()) == 7
    second = recover_train(out, *BASE, "--replicas", "4", "--resume", "--dump-final-params",
                           data=corpus)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in second.metrics()] == list(range(14))
    assert max_rel(second.losses(), ref4.losses()) < 1e-6
    assert rel_l2(second.final(0), ref4.final(0)) < 1e-4


def test_torchrun_workers_match(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    """One `torchrun` per replica against `recover train --external-workers`: same trajectory.
    Where the torchx extra is installed, tests/test_torchx.py runs this (and a kill and a
    restart) through the component's commands, so this runs only without it."""
    if importlib.util.find_spec("torchx") is not None:
        pytest.skip("covered by tests/test_torchx.py (one torchrun per replica, with a restart)")
    port = two_free_ports()  # the coordinator's store port, and + 1 for its liveness listener
    out = tmp_path / "run"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    server = Launch(out, *BASE, "--replicas", "2", "--external-workers", "--port", str(port),
                    data=corpus)
    replicas = []
    try:
        for r in range(2):
            replicas.append(subprocess.Popen(
                [torchrun, "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
                 "-m", "recover.app.train.worker", "--run-dir", str(out),
                 "--replica", str(r), "--coordinator", f"127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        res = server.finish(240)
        assert res.returncode == 0, res.stderr[-3000:]
        for p in replicas:
            assert p.wait(timeout=60) == 0
    finally:
        for p in replicas:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert max_rel(res.losses(), ref4.losses()) < 1e-5


def test_config_of_an_earlier_run(ref4: Run, tmp_path: Path) -> None:
    """`--config DIR/config.json`: a new run with that run's settings, flags on top (here a
    shorter run on fewer replicas); its own directory, not the earlier one's."""
    run = recover_train(tmp_path / "again", "--config", str(ref4.out / rundir.CONFIG),
                        "--steps", "3", "--replicas", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    earlier = json.loads((ref4.out / rundir.CONFIG).read_text())
    now = json.loads((run.out / rundir.CONFIG).read_text())
    assert now["run"]["out"] == str(run.out)
    assert (now["run"]["steps"], now["layout"]["replicas"]) == (3, 2)
    for sec, key in (("run", "out"), ("run", "steps"), ("layout", "replicas")):
        now[sec][key] = earlier[sec][key]
    assert now == earlier
    # The same model, data and seed: step 0 (before any update) has the earlier run's loss.
    assert max_rel(run.losses()[:1], ref4.losses()[:1]) < 1e-5
