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

from faults.conftest import Row, check_run, fault_args, faulty, gaps, measure
from harness import viewers
from harness.runs import Run, recover_train
from recover.app import rundir

pytestmark = pytest.mark.timeout(200)


def test_coordinator_killed_and_restarted(ref4: Run, corpus: Path, tmp_path: Path,
                                          record: Row) -> None:
    record.scenario = ("coordinator killed and restarted: while a replacement is being admitted "
                       "(the donor's `donate` phase), then mid-compute (backward); 2 store "
                       "shards")
    record.expected = ("the replicas keep their state and wait; `recover train` restarts it "
                       "(--recover); the run resumes at the last committed step; the replacement, "
                       "which held no state, is healed by transfer and admitted")
    run = faulty(tmp_path, corpus, "kill:replica=2,step=3,phase=backward",
                 "restart:replica=2,step=6", "coordinator:replica=0,step=6,phase=donate",
                 "coordinator:replica=1,step=10,phase=backward",  # shards: each coordinator's
                 extra=("--store-shards", "2", "--tensorboard", "auto"))
    events = [json.loads(x) for x in (run.out / rundir.COORDINATOR_LOG).read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resumed"]
    starts = [e["time"] for e in events if e["event"] == "start"]
    took = [r["time"] - s for r, s in zip(resumed, starts[1:], strict=False)]
    record.measured = (measure(run) + "; restart -> resumed "
                       + ", ".join(f"{t:.2f} s" for t in took))
    check_run(run, ref4, [0, 1, 2, 3])
    assert len(starts) == 3, starts
    assert all(len(e["shard_ports"]) == 2 for e in events if e["event"] == "start"), events
    # Killed while replica 0 served the replacement at step 6 (nothing of step 6 computed): the
    # run resumed at 6 with the three replicas that held it, and healed the replacement (-1: no
    # state) from one of them. Killed while computing step 10: all four resumed at 10.
    assert [(r["step"], r["members"], r["heal"]) for r in resumed] == \
        [(6, [0, 1, 3], [2]), (10, [0, 1, 2, 3], [])], resumed
    assert resumed[0]["registered"]["2"] == {"0": -1}, resumed[0]
    for r in (0, 1, 3):
        assert run.log(r).count("the restarted coordinator resumed the run") == 2, run.log(r)
    # Each restart is a text event in TensorBoard at the step the launcher was waiting for when
    # the coordinator died: the killed step's, or the one before if the kill came before the
    # launcher read that step's line (it polls the store every 20 ms).
    texts = viewers.tensorboard(run.out / "tensorboard")[1]["events/coordinator"]
    assert len(texts) == 2, texts
    first, second = sorted(texts)
    assert first in (5, 6) and second in (9, 10), texts
    assert all(f"coordinator died (exit code -9) at step {s}" in t for s, t in texts.items()), texts


def test_a_restarted_coordinator_does_not_wait_again_for_a_replacement_that_came(
        ref4: Run, corpus: Path, tmp_path: Path, record: Row) -> None:
    """Found by `bench/soak.py --minutes 30 --seed 61`, run 145 (72 s where its others took 4-17):
    replica 3's replacement, scheduled for step 10, registered and was admitted, then evicted
    again (its cut goes on); the coordinator died at step 10's commit. After the restart the
    run went back to step 10's boundary, where the plan waited the fault injection's 60 s for a
    replacement that had come and gone, and the replica preempted there ran out of its grace."""
    record.scenario = ("a scheduled replacement admitted and evicted again, then the "
                       "coordinator killed at that step's commit, a replica preempted there")
    record.expected = ("the run resumes at that step without waiting for the replacement again; "
                       "the preempted replica leaves cleanly")
    run = faulty(tmp_path, corpus, "partition:replica=2,step=4", "partition:replica=3,step=8",
                 "restart:replica=3,step=10", "coordinator:replica=0,step=10,phase=commit",
                 "preempt:replica=1,step=10,phase=commit", static=False)
    recs = check_run(run, ref4, [0])
    record.measured = measure(run)
    assert max(gaps(recs)) < 30, gaps(recs)  # 65 s before: the scheduled join's bound
    exits = json.loads((run.out / rundir.REPLICA_EXITS).read_text())
    assert exits["1"].startswith("exit 0 (preempted)"), exits


def test_a_coordinator_death_prints_no_torch_stack(corpus: Path, tmp_path: Path,
                                                   record: Row) -> None:
    """Found by `bench/soak.py --minutes 30` at 0.16.2: 81 of its 82 coordinator kills printed on
    the launcher's terminal, before recover's own line about it, torch's C++ warning of the
    launcher's store read that failed, with a C++ stack of 20 frames. The `recover` command's own
    process now shows torch's C++ errors only (recover.app.entry); its children log as before."""
    record.scenario = "the coordinator killed, the launcher started as a user starts it"
    record.expected = ("one line from recover about the death and the restart; no C++ stack "
                       "from torch on the terminal")
    fault = "coordinator:replica=0,step=4,phase=backward"
    run = recover_train(tmp_path / "run", *fault_args(fault), data=corpus, timeout=150,
                        fresh=True)  # `python -m recover`, as a user starts it: not forked
    record.measured = measure(run)
    assert run.returncode == 0, run.stderr[-3000:]
    shown = run.stdout + run.stderr
    assert "coordinator died (exit code -9) at step" in shown, shown[-3000:]
    assert "Exception raised from" not in shown and "frame #" not in shown, shown[-3000:]
