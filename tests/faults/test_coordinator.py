"""The coordinator killed (SIGKILL, by a `coordinator` fault at a chosen point) and restarted.

`recover train` restarts it with `--recover` on the same address; the replicas keep their state
meanwhile, re-register with the steps they applied, and the run resumes from the last committed
step: checked by `conftest.check_run` like every scenario (steps exactly once, losses on the
failure-free trajectory, replicas bitwise equal, the last checkpoint loads).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _run import Run
from faults.conftest import _MATRIX, Row, check_run, faulty

pytestmark = pytest.mark.timeout(200)


def test_coordinator_killed_and_restarted(ref4: Run, corpus: Path, tmp_path: Path,
                                          record: Row) -> None:
    record.scenario = ("coordinator killed and restarted: after a commit decision (optimizer "
                       "phase), then mid-compute (backward)")
    record.expected = ("the replicas keep their state and wait; `recover train` restarts it "
                       "(--recover); the run resumes at the last committed step, twice")
    run = faulty(tmp_path, corpus, "coordinator:replica=0,step=4,phase=optimizer",
                 "coordinator:replica=2,step=9,phase=backward")
    events = [json.loads(x) for x in (run.out / "coordinator.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resumed"]
    starts = [e["time"] for e in events if e["event"] == "start"]
    took = [r["time"] - s for r, s in zip(resumed, starts[1:], strict=False)]
    record.measured = (_MATRIX.measure(run) + "; restart -> resumed "
                       + ", ".join(f"{t:.2f} s" for t in took))
    check_run(run, ref4, [0, 1, 2, 3])
    # Killed after step 4's decision: every replica applied it and resumed at 5. Killed while
    # computing step 9: nobody committed it, so the run resumed at 9 and recomputed it.
    assert [r["step"] for r in resumed] == [5, 9], resumed
    assert all(r["members"] == [0, 1, 2, 3] for r in resumed), resumed
    assert len(starts) == 3
    for r in range(4):
        assert run.log(r).count("the restarted coordinator resumed the run") == 2, run.log(r)
