"""Crashes, hangs, stragglers, deadlocks and rejoins in real `recover train` runs.

Each test is one run (several faults per run where they do not interfere) checked by
`conftest.check_run` against the shared failure-free reference; what a scenario adds (who
survives, who was fenced, how fast) is asserted here. Replica r owns ids 8s+2r, 8s+2r+1
of each step with static quotas (ids of step s: 8s..8s+7; R=4, N=8), which is what the
microbatch-aimed faults rely on.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from faults.conftest import Row, check_run, faulty, gaps, measure
from harness import viewers
from harness.runs import Run
from recover.app import rundir

pytestmark = pytest.mark.timeout(200)
STALE_S = 2.0  # the default --stale-s (recover.app.config.FtConfig)


@pytest.fixture(scope="module")
def ref(ref4: Run) -> Run:
    return ref4


def recorded(record: Row, tmp_path: Path, corpus: Path, scenario: str, expected: str,
             *faults: str) -> Run:
    """One faulty run, described and measured for docs/faults.md."""
    record.scenario, record.expected = scenario, expected
    run = faulty(tmp_path, corpus, *faults)
    record.measured = measure(run)
    return run


def test_kill_in_each_phase_down_to_one(ref: Run, corpus: Path, tmp_path: Path,
                                        record: Row) -> None:
    run = recorded(record, tmp_path, corpus,
                   "crash in forward, backward, reduce; down to one survivor",
                   "each loss recovered in-step; replica 0 ends alone with all 8 microbatches",
                   "kill:replica=3,step=3,phase=forward,microbatch=1",
                   "kill:replica=2,step=6,phase=backward", "kill:replica=1,step=10,phase=reduce")
    recs = check_run(run, ref, [0])
    assert [r["live_replicas"] for r in (recs[2], recs[3], recs[6])] == [4, 3, 2]
    # Killed mid-compute with equal quotas over [0, 1, 2]: exactly its ids (54, 55) recomputed.
    assert recs[6]["recovered"] == [54, 55], recs[6]["recovered"]
    # A kill "in the reduce" can land just after the collective completed: then step 10 still
    # commits with replica 1's ids and step 11 runs without it.
    assert recs[11]["live_replicas"] == 1
    assert recs[-1]["quotas"] == {"0": 8}
    assert all(f"injecting kill:replica={r}" in run.log(r) for r in (1, 2, 3))


def test_two_at_once_and_optimizer_phase(ref: Run, corpus: Path, tmp_path: Path,
                                         record: Row) -> None:
    run = recorded(record, tmp_path, corpus,
                   "two crashes at once (commit phase), then one after the commit decision",
                   "both losses handled in one recovery; the optimizer-phase loss too",
                   "kill:replica=1,step=4,phase=commit", "kill:replica=2,step=4,phase=commit",
                   "kill:replica=3,step=9,phase=optimizer")
    recs = check_run(run, ref, [0])
    # Killed after the reduce: step 4's gradient already holds their ids; step 5 runs without.
    assert recs[3]["live_replicas"] == 4 and recs[5]["live_replicas"] == 2
    assert recs[-1]["live_replicas"] == 1


def test_crash_during_recovery(ref: Run, corpus: Path, tmp_path: Path, record: Row) -> None:
    record.scenario = ("crash during recovery (the recomputing replica dies), with 3 store "
                       "shards")
    record.expected = "the second loss is recovered too; the step commits once"
    # Replica 2 computes its own 2 microbatches (j=0,1) of step 5; its third (j=2) exists only
    # when it recomputes replica 1's, so the kill lands inside the recovery. With 3 shards
    # (replica r counts on shard r % 3) both deaths empty a shard: 1 and 2.
    run = faulty(tmp_path, corpus, "kill:replica=1,step=5,phase=forward",
                 "kill:replica=2,step=5,phase=backward,microbatch=2",
                 extra=("--store-shards", "3"))
    record.measured = measure(run)
    recs = check_run(run, ref, [0, 3])
    ports = json.loads((run.out / rundir.COORDINATOR_LOG).read_text().splitlines()[0])
    assert len(ports["shard_ports"]) == 3, ports
    assert "injecting kill" in run.log(2), run.log(2)[-2000:]
    # Step 5's ids are 40..47; replicas 1 and 2 owned 42..45, all recomputed by 0 and 3.
    assert recs[5]["live_replicas"] == 2 and sorted(recs[5]["recovered"]) == [42, 43, 44, 45]


def test_hang_fenced(ref: Run, corpus: Path, tmp_path: Path, record: Row) -> None:
    record.scenario = ("hang (SIGSTOP 3 s) in backward, then the leader's crash after a "
                       "commit (optimizer phase)")
    record.expected = ("the hung replica is fenced and exits; the leader's record is offered "
                       "by the others; survivors bitwise equal")
    run = faulty(tmp_path, corpus, "hang:replica=3,step=4,seconds=3,phase=backward",
                 "kill:replica=0,step=8,phase=optimizer")
    record.measured = measure(run)
    recs = check_run(run, ref, [1, 2])  # step 8's line too: contiguous steps are checked
    assert "fenced" in run.log(3), run.log(3)[-2000:]
    assert recs[-1]["live_replicas"] == 2


def test_faults_inside_an_overlapped_bucket(ref: Run, corpus: Path, tmp_path: Path,
                                            record: Row) -> None:
    record.scenario = ("crash, then hang (SIGSTOP 3 s), while a bucket of the gradient is reduced "
                       "and the last microbatch's backward still runs (--bucket-mb 0.05)")
    record.expected = ("recovered as a fault in the reduce is: the lost microbatches recomputed, "
                       "N microbatches committed; the hung replica fenced")
    # The debug model's 0.5 MB gradient in 0.05 MiB buckets: 10 operations a step, the first
    # ones issued from autograd's hooks while the backward goes on. The `bucket` phase fires
    # only then: a run that did not overlap never injects these faults, and fails below.
    run = faulty(tmp_path, corpus, "kill:replica=1,step=3,phase=bucket",
                 "hang:replica=3,step=7,seconds=3,phase=bucket", extra=("--bucket-mb", "0.05"))
    record.measured = measure(run)
    recs = check_run(run, ref, [0, 2])
    assert "injecting kill:replica=1,step=3,phase=bucket" in run.log(1), run.log(1)[-2000:]
    assert "injecting hang:replica=3,step=7,phase=bucket" in run.log(3), run.log(3)[-2000:]
    # Step 3's ids are 24..31; replica 1 died in the backward of its last one: none of its
    # buckets completed anywhere, so exactly its two ids were recomputed.
    assert recs[3]["recovered"] == [26, 27], recs[3]
    assert recs[3]["live_replicas"] == 3 and recs[-1]["live_replicas"] == 2
    assert "fenced" in run.log(3), run.log(3)[-2000:]


def test_straggler_and_rejoin_during_fault(ref: Run, corpus: Path, tmp_path: Path,
                                           record: Row) -> None:
    record.scenario = "straggler (3x slow) not fenced; a crash and its replacement rejoining"
    record.expected = "straggler stays a member; replica 2 rejoins, 4 live at the end"
    # The run's views ride on this run (a kill and a rejoin): TensorBoard (the default, auto), W&B
    # offline (no network; its files under tmp_path), the launcher's piped output.
    wandb_dir = tmp_path / "wandb"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir),
           "WANDB_CONFIG_DIR": str(wandb_dir / "config"), "WANDB_CACHE_DIR": str(wandb_dir)}
    run = faulty(tmp_path, corpus, "slow:replica=1,factor=3", "kill:replica=2,step=4,"
                 "phase=backward", "restart:replica=2,step=7", static=False,
                 extra=("--wandb", "recover-tests", "--tensorboard", "auto"), env=env)
    record.measured = measure(run)
    recs = check_run(run, ref, [0, 1, 2, 3])
    assert all(1 in r["members"] for r in recs), "a straggler must not be fenced"
    assert recs[4]["live_replicas"] == 3 and recs[-1]["live_replicas"] == 4
    assert any(2 in r["members"] for r in recs[7:8]), [r["members"] for r in recs]
    late = recs[-4:]  # speed-aware quotas: the 3x straggler gets fewer microbatches
    assert all(r["quotas"]["1"] < max(r["quotas"].values()) for r in late), late
    fault = next(r["step"] for r in recs if 2 not in r["members"])
    join = next(r["step"] for r in recs if "joined" in r)
    assert recs[join]["joined"] == [2] and fault < join, (fault, join)
    check_views(run, recs, fault, join, wandb_dir)
    for r in range(4):  # the healthy reference's replica logs: a timestamped line per step
        assert_timestamped_steps(ref.log(r), STEP_LOG, len(recs))
    assert_timestamped_steps(ref.stderr, STEP_LINE, len(recs))


# A launcher step line when piped (train/progress.py) and a replica's step line (logging).
STEP = r"step +(\d+)/\d+  loss .* elapsed \d+:\d\d:\d\d  eta (\?|\d+:\d\d:\d\d)$"
STEP_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d " + STEP)
STEP_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO \S+: " + STEP)


def assert_timestamped_steps(text: str, line: re.Pattern, steps: int) -> None:
    """A timestamped line for each of `steps` steps in `text`, and every line whole: each one
    starts as a line of recover's output starts (a wrapped line's tail would not)."""
    lines = [x for x in text.splitlines() if x.strip()]
    assert lines, "empty output"
    found = [m for m in map(line.match, lines) if m]
    seen = sorted(int(m.group(1)) for m in found)
    assert seen == list(range(steps)), (seen, text[-2000:])
    assert found[-1].group(2) == "0:00:00", found[-1].group(0)  # the ETA counts down to the end
    heads = re.compile(r"^(\d{4}-\d\d-\d\d[T ]|recover: |replica exits: |done: )")
    broken = [x for x in lines if not heads.match(x)]
    assert not broken, broken


def check_views(run: Run, recs: list[dict], fault: int, join: int, wandb_dir: Path) -> None:
    """TensorBoard's and W&B's records of the run, read back with their own readers, hold
    metrics.jsonl's losses and the fault and the join at their steps; the piped console output
    has a timestamped line per step and no line broken by wrapping."""
    scalars, texts = viewers.tensorboard(run.out / "tensorboard")
    # TensorBoard stores scalars as float32: equal to metrics.jsonl's loss rounded so.
    assert scalars["loss"] == {r["step"]: float(np.float32(r["loss"])) for r in recs}
    assert {"lr", "grad_norm", "tokens_per_s", "live_replicas", "recovery_s"} <= set(scalars)
    assert scalars["live_replicas"][fault] == 3 and scalars["live_replicas"][join] == 4
    assert "replica 2 left the job" in texts["events/fault"][fault], texts
    assert set(texts["events/join"]) == {join} and "replica 2 joined" in texts["events/join"][join]
    (wb_run,) = (wandb_dir / "wandb").glob("offline-run-*")
    history = viewers.wandb_history(wb_run)
    assert {s: h["loss"] for s, h in history.items()} == {r["step"]: r["loss"] for r in recs}
    assert "replica 2 left the job" in history[fault]["events/fault"], history[fault]
    assert "replica 2 joined" in history[join]["events/join"], history[join]
    assert viewers.wandb_config(wb_run)["run"]["steps"] == len(recs)
    assert_timestamped_steps(run.stderr, STEP_LINE, len(recs))


@pytest.mark.slow
def test_deadlock_fenced_in_time(ref: Run, corpus: Path, tmp_path: Path, record: Row) -> None:
    record.scenario = ("deadlocks between steps (the optimizer) and in reduce (main thread "
                       "stuck, heartbeats alive), the reduce timeout the default 60 s")
    record.expected = (f"the one in reduce fenced by its watchdog (exit 7), the one between "
                       f"steps evicted on the others' wait for it (exit 3); steps 5 and 10 each "
                       f"commit within 3 x stale-s + 5 = {3 * STALE_S + 5:.0f} s")
    run = faulty(tmp_path, corpus, "deadlock:replica=2,step=4,phase=optimizer",
                 "deadlock:replica=1,step=10,phase=reduce")
    recs = check_run(run, ref, [0, 3])
    between = recs[5]["time_s"] - recs[4]["time_s"]
    took = recs[10]["time_s"] - recs[9]["time_s"]
    record.measured = (f"step 5 committed {between:.2f} s after step 4, step 10 {took:.2f} s "
                       f"after step 9; " + measure(run))
    # Before, a deadlock between steps cost the others the whole reduce timeout (its own
    # watchdog's bound there); before that, it failed every replica after 32 rebuilds.
    assert between < 3 * STALE_S + 5, between
    assert took < 3 * STALE_S + 5, took
    assert "injecting deadlock" in run.log(1) and "injecting deadlock" in run.log(2)
    exits = json.loads((run.out / rundir.EXIT_CODES).read_text())
    assert exits.get("replica1.rank0") == 7 and exits.get("replica2.rank0") == 3, exits
    why = json.loads((run.out / rundir.REPLICA_EXITS).read_text())
    assert "its main thread stalled" in json.dumps(why.get("2", why)), why


def test_all_lost(ref: Run, corpus: Path, tmp_path: Path, record: Row) -> None:
    record.scenario = "all replicas lost (every one killed in step 6)"
    record.expected = "clean non-zero exit, a clear message, the step-5 checkpoint loads"
    run = faulty(tmp_path, corpus, *(f"kill:replica={r},step=6,phase={p}" for r, p in
                                     enumerate(("forward", "backward", "reduce", "commit"))),
                 expect_rc=None)
    record.measured = f"exit {run.returncode}; " + measure(run)
    check_run(run, ref, [], steps=6)
    assert "Traceback" not in run.stderr
    assert "lost" in run.stderr.lower() or "checkpoint" in run.stderr.lower(), run.stderr[-2000:]
    assert max(gaps(run.metrics())) < 30


def test_partition_evicted_on_evidence(ref: Run, corpus: Path, tmp_path: Path,
                                       record: Row) -> None:
    record.scenario = ("partition: one replica's cross-replica traffic fails, heartbeats alive; "
                       "later, with two members left, one of them is cut off too")
    record.expected = ("it reports a cut to every peer; the cut rule evicts it, not the others "
                       "(they reach each other); of the last two, exactly one goes (a tie the "
                       "rule decides); the evicted are fenced (3); survivors commit")
    run = faulty(tmp_path, corpus, "partition:replica=1,step=5", "kill:replica=3,step=7,"
                 "phase=forward", "partition:replica=2,step=9")
    record.measured = measure(run)
    events = [json.loads(x) for x in (run.out / rundir.COORDINATOR_LOG).read_text().splitlines()]
    gens = [e for e in events if e["event"] == "generation"]
    evicted = [e for e in gens if 1 not in e["members"]]
    assert evicted and "replica 1: unreachable from replicas 0, 2, 3 over the data path" in \
        evicted[0]["reason"], evicted[:1]
    assert evicted[0]["members"] == [0, 2, 3]  # none of the others
    # Two members that cannot reach each other: never both kept (the run would stop after 32
    # failed attempts), never both evicted.
    last = gens[-1]["members"] if gens[-1]["members"] else gens[-2]["members"]
    assert len(last) == 1 and last[0] in (0, 2), [g["members"] for g in gens]
    recs = check_run(run, ref, last)
    assert recs[-1]["live_replicas"] == 1
    codes = json.loads((run.out / rundir.EXIT_CODES).read_text())
    assert codes["replica1.rank0"] == 3 and codes[f"replica{2 - last[0]}.rank0"] == 3, codes
