"""Preemption (issue #30): SIGTERM as a planned leave, and a preempted job that loses nothing.

Invariant under test: a replica's SIGTERM ends its work at the step boundary (exit 0, the
coordinator's reason `preempted`, its later ids moved to the others, nothing it reduced computed
again); a second SIGTERM within the step is today's crash; SIGTERM to `recover train` leaves a
checkpoint of the last committed step, the exit records and exit code 8, and `--resume` goes on
along the failure-free trajectory.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from faults.conftest import N, check_run, faulty, load_last_checkpoint
from harness.runs import BASE, Launch, Run, max_rel, read_jsonl, recover_train
from recover.app import rundir
from recover.errors import ExitCode


def test_replica_sigterm_is_a_planned_leave(tmp_path: Path, corpus: Path, ref4: Run) -> None:
    # Replica 2: one SIGTERM mid-step 5 (leaves after it). Replica 1: one SIGTERM at step 3,
    # and a replacement from step 9 (rejoins). Replica 3: two SIGTERMs within step 7 (a crash).
    run = faulty(tmp_path, corpus, "preempt:replica=2,step=5,phase=backward",
                 "preempt:replica=1,step=3,phase=forward", "restart:replica=1,step=9",
                 "preempt:replica=3,step=7,phase=forward",
                 "preempt:replica=3,step=7,phase=backward")
    recs = check_run(run, ref4, survivors=[0, 1])
    by_step = {r["step"]: r for r in recs}
    # The steps the preempted replicas were in commit as planned: all N, nothing recovered.
    for s in (3, 5):
        assert by_step[s]["recovered"] == [] and by_step[s]["microbatches"] == N, by_step[s]
        assert by_step[s + 1]["members"] == [m for m in by_step[s]["members"]
                                             if m != {3: 1, 5: 2}[s]], by_step[s + 1]
    assert 1 in by_step[9]["members"], "the replacement did not rejoin"
    exits = json.loads((run.out / rundir.REPLICA_EXITS).read_text())
    assert exits["2"] == "exit 0 (preempted), coordinator: left cleanly (preempted)", exits
    codes = json.loads((run.out / rundir.EXIT_CODES).read_text())
    assert codes["replica3.rank0"] == -signal.SIGTERM, codes  # the second SIGTERM: a crash
    events = read_jsonl(run.out / rundir.COORDINATOR_LOG)
    leaves = [e["reason"] for e in events if e.get("event") == "evidence" and e["replica"] == 2]
    assert leaves == ["left cleanly (preempted)"], leaves  # a leave, no loss counted
    assert "preempted (SIGTERM): leaving at the step boundary after step 5" in run.log(2)


def _wait_records(out: Path, n: int, launch: Launch, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    path = out / rundir.METRICS
    while time.monotonic() < deadline and launch.running():
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} records within {timeout_s}s: {launch.stderr()[-2000:]}")


def test_sigterm_to_recover_train_checkpoints_and_resumes(tmp_path: Path, corpus: Path,
                                                          ref4: Run) -> None:
    out = tmp_path / "run"
    # R=2 against the R=4 reference: the trajectory does not depend on R (the invariant).
    args = [*BASE, "--replicas", "2"]
    launch = Launch(out, *args, data=corpus)
    _wait_records(out, 4, launch)
    os.kill(launch.pid, signal.SIGTERM)  # what a scheduler sends the launcher
    run = launch.finish(timeout=60)
    assert run.returncode == ExitCode.PREEMPTED, (run.returncode, run.stderr[-3000:])
    committed = len(run.metrics())
    assert 4 <= committed < 14, committed
    step, _ = load_last_checkpoint(out)
    assert step == committed, (step, committed)  # the last committed step, with no --ckpt-every
    exits = json.loads((out / rundir.REPLICA_EXITS).read_text())
    assert all("left cleanly (preempted)" in e for e in exits.values()), exits
    assert json.loads((out / rundir.EXIT_CODES).read_text()) == {
        "replica0.rank0": 0, "replica1.rank0": 0}
    assert "continue with --resume" in run.stderr
    resumed = recover_train(out, *args, "--resume", data=corpus, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in resumed.metrics()] == list(range(14))
    assert max_rel(resumed.losses(), ref4.losses()) < 1e-5
