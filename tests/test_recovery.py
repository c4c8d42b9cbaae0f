"""In-step recovery under real faults: SIGKILL, SIGSTOP, slowness at a (replica, step, phase).

Each run is compared with the failure-free reference: every step's loss within relative 1e-5, final
parameters within relative L2 1e-4 (docs/DESIGN.md, "The invariant and its tolerances"), survivors
bitwise equal to each other, and `microbatches` = N on every step, including the recovered ones.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from harness.runs import BASE, Launch, Run, bitwise_equal, max_rel, recover_train, rel_l2
from recover.app import rundir

pytestmark = pytest.mark.timeout(300)
N = 8


@pytest.fixture(scope="module")
def ref(ref4: Run) -> Run:
    return ref4


def faulty(tmp_path: Path, corpus: Path, *faults: str, replicas: int = 4,
           static: bool = True) -> Run:
    # Static (equal) quotas make "which ids did replica r own" predictable for the assertions.
    args = [*BASE, "--replicas", str(replicas), "--dump-final-params"]
    args += [] if static else ["--speed-aware"]
    for f in faults:
        args += ["--fault", f]
    run = recover_train(tmp_path / "run", *args, data=corpus)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def check_against(run: Run, ref: Run, survivors: list[int]) -> list[dict]:
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(len(ref.metrics())))
    assert all(r["microbatches"] == N for r in recs), [r["microbatches"] for r in recs]
    assert all(sum(r["quotas"].values()) == N for r in recs)
    assert max_rel(run.losses(), ref.losses()) < 1e-5
    finals = run.finals()
    missing = sorted(set(survivors) - set(finals))
    assert not missing, "\n".join(f"replica {r}:\n{run.log(r)[-3000:]}" for r in missing) + \
        (run.out / rundir.COORDINATOR_LOG).read_text()[-3000:]
    assert sorted(finals) == survivors
    first = finals[survivors[0]]
    assert all(bitwise_equal(first, finals[s]) for s in survivors), "survivors diverged"
    assert rel_l2(first, ref.final(0)) < 1e-4
    return recs


# Crashes in every phase, down to one survivor, a hang, a straggler: the fault matrix
# (tests/faults/test_crashes.py), one real run per scenario, checked against this reference too.


def test_below_min_replicas_stops_with_checkpoint(corpus: Path, tmp_path: Path) -> None:
    args = [*BASE, "--replicas", "4", "--min-replicas", "3",
            "--fault", "kill:replica=1,step=3,phase=backward",
            "--fault", "kill:replica=2,step=6,phase=backward"]
    run = recover_train(tmp_path / "run", *args, data=corpus)
    assert run.returncode == 1
    assert "--min-replicas 3" in run.stderr and "checkpoint at step 6" in run.stderr
    assert "Traceback" not in run.stderr
    assert [r["step"] for r in run.metrics()] == list(range(6))
    assert (tmp_path / "run" / "ckpt" / "step_00000006").is_dir()


def test_coordinator_death_checkpoints_and_stops(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Not restarted (restarts 0): the replicas keep their state for 2 s, then checkpoint and stop.
    run = Launch(out, *BASE, "--steps", "400", "--replicas", "2", "--coordinator-restarts", "0",
                 "--coordinator-wait-s", "2", data=corpus)
    try:
        deadline = time.monotonic() + 120
        while not (out / rundir.METRICS).exists() or \
                len((out / rundir.METRICS).read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and run.proc.poll() is None, "run did not start"
            time.sleep(0.05)
        coord_pid = json.loads((out / rundir.COORDINATOR_LOG).read_text().splitlines()[0])["pid"]
        os.kill(coord_pid, signal.SIGKILL)  # by the PID it logged (a child of the launcher's)
    finally:
        res = run.finish(120)
    assert res.returncode == 1
    assert "coordinator died" in res.stderr and "Traceback" not in res.stderr
    assert any((out / rundir.CKPT).glob("step_*")), "the leader must checkpoint the committed state"
    log = (out / rundir.LOGS / "replica0.log").read_text()
    assert "waiting up to 2s for it to restart" in log and "no coordinator came back" in log, log
