"""The last step's line is never lost: whichever replica dies in whichever phase of the last
step, after earlier faults, the run ends with exit 0 and every committed step's line exactly
once, on the failure-free trajectory.

Before 0.17 a leader killed after the last step's commit (the optimizer phase) left only the
other replicas' `ckpt_pending` records, which the sink waits on for the writer's; with every
process gone it stopped one line short and `recover train` said "training stopped at step S-1".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.conftest import N, faulty
from harness.runs import BASE, Run, max_rel

pytestmark = pytest.mark.timeout(200)
LAST = int(BASE[BASE.index("--steps") + 1]) - 1


@pytest.mark.parametrize("leader_phase,other_phase", [("optimizer", "commit"),
                                                      ("commit", "optimizer")])
def test_last_step_line_survives_its_writer(ref4: Run, corpus: Path, tmp_path: Path,
                                            leader_phase: str, other_phase: str) -> None:
    run = faulty(tmp_path, corpus, "kill:replica=3,step=4,phase=backward",
                 f"kill:replica=0,step={LAST},phase={leader_phase}",
                 f"kill:replica=1,step={LAST},phase={other_phase}")
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(LAST + 1)), [r["step"] for r in recs]
    assert all(r["microbatches"] == N for r in recs)
    assert max_rel(run.losses(), ref4.losses()) < 1e-5
    assert "training stopped" not in run.stderr
