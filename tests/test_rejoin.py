"""Growing back: a replica killed and started again rejoins the running job with a live state
transfer, on the failure-free trajectory (real processes, real SIGKILLs, real sockets).

Each run is checked against the failure-free reference (losses within 1e-5 relative at every
step), with N microbatches on every metrics line and every replica's final parameters bitwise
equal to the others' (the joiner's included); plus: a donor or a joiner that dies during the
transfer costs the running replicas no step, and the join succeeds with another donor or later.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.runs import BASE, Run, bitwise_equal, max_rel, recover_train
from recover.app import rundir

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
N = 8


def _check(run: Run, ref: Run, replicas: list[str]) -> list[dict]:
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(len(ref.metrics())))
    assert all(r["microbatches"] == N for r in recs)
    assert max_rel(run.losses(), ref.losses()) < 1e-5
    finals = {p.stem: p for p in sorted((run.out / rundir.FINAL).glob("replica*.pt"))}
    assert sorted(finals) == replicas, sorted(finals)
    import torch

    loaded = [torch.load(p, weights_only=True) for p in finals.values()]
    assert all(bitwise_equal(loaded[0], x) for x in loaded[1:]), "replicas diverged"
    return recs


def _rejoin_run(tmp_path: Path, corpus: Path, replica: int, dies: str) -> Run:
    """Four replicas; `replica` is killed at step 3 and restarted for step 6, where `dies`
    strikes during the state transfer."""
    return recover_train(tmp_path / "run", *BASE, "--replicas", "4", "--dump-final-params",
                         "--fault", f"kill:replica={replica},step=3,phase=backward",
                         "--fault", f"restart:replica={replica},step=6", "--fault", dies,
                         data=corpus)


def test_killed_replica_rejoins(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    run = recover_train(tmp_path / "run", *BASE, "--replicas", "4", "--dump-final-params",
                        "--fault", "kill:replica=2,step=4,phase=backward",
                        "--fault", "restart:replica=2,step=8", data=corpus)
    recs = _check(run, ref4, ["replica0", "replica1", "replica2", "replica3"])
    assert [r["live_replicas"] for r in recs[4:8]] == [3] * 4
    assert all(r["live_replicas"] == 4 for r in recs[8:]), [r["live_replicas"] for r in recs]
    assert recs[8]["joined"] == [2] and recs[8]["transfer_s"] >= 0
    assert sum(recs[9]["quotas"].values()) == N and "2" in recs[9]["quotas"]  # it has a share
    assert "joined the running job at step 8" in run.log(2)


def test_donor_and_joiner_die_during_transfers(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    """Replica 3 is killed at 3 and restarted for step 6: the donor (replica 0, the lowest) is
    killed as it starts streaming, so the join is given up and tried again with replica 1 as the
    donor at a later boundary; no running replica loses a step."""
    run = _rejoin_run(tmp_path, corpus, replica=3, dies="kill:replica=0,step=6,phase=donate")
    recs = _check(run, ref4, ["replica1", "replica2", "replica3"])
    joined = [r["step"] for r in recs if r.get("joined")]
    assert joined and joined[0] >= 6, joined
    assert recs[-1]["live_replicas"] == 3
    events = [json.loads(x) for x in (run.out / rundir.COORDINATOR_LOG).read_text().splitlines()]
    kinds = [e["event"] for e in events if e["event"] in ("join", "join-failed")]
    assert kinds[:3] == ["join", "join-failed", "join"], kinds  # given up, then another donor
    assert "donated" in run.log(1)


def test_joiner_dies_during_transfer(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    """Replica 2, restarted for step 6, dies as it starts receiving: the join is given up and
    the others go on without it, on the trajectory, without losing a step."""
    run = _rejoin_run(tmp_path, corpus, replica=2, dies="kill:replica=2,step=6,phase=receive")
    recs = _check(run, ref4, ["replica0", "replica1", "replica3"])
    assert all(r["live_replicas"] == 3 for r in recs[3:])
    assert not any(r.get("joined") for r in recs)


def test_hsdp_replica_rejoins(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    """HSDP 2x2: rank k of the donor replica streams its FSDP2 shards and their AdamW state to
    rank k of the joiner, copied in place into the joiner's own shards."""
    import torch

    run = recover_train(tmp_path / "run", *BASE, "--replicas", "2", "--layout", "hsdp",
                        "--shards", "2", "--dump-final-params",
                        "--fault", "kill:replica=1,step=3,phase=backward",
                        "--fault", "restart:replica=1,step=6", data=corpus)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["live_replicas"] for r in recs] == [2] * 3 + [1] * 3 + [2] * 8
    assert recs[6]["joined"] == [1] and all(r["microbatches"] == N for r in recs)
    assert max_rel(run.losses(), ref4.losses()) < 1e-5
    for k in range(2):
        a, b = (torch.load(run.out / rundir.FINAL / f"replica{r}.rank{k}.pt", weights_only=True)
                for r in range(2))
        assert bitwise_equal(a, b), f"rank {k} diverged"
