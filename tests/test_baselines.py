"""The baselines: the bench's fault schedule, Young-Daly, shrink-batch and abort-on-loss launches.

The schedule and K are pure functions (fast tests); shrink-batch and the torn-down launch are real
multi-process runs with a real SIGKILL.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.runs import BASE, Run, bitwise_equal, max_rel, recover_train
from recover.app.baselines.ckpt_restart import AbortOnLoss, young_daly_k
from recover.app.baselines.schedule import bench_schedule, remap
from recover.app.config import preset
from recover.app.faults import PHASES, validate_faults
from recover.app.train.launch import launch
from recover.errors import ConfigError


def test_schedule_is_seeded_spread_and_kills_half() -> None:
    a = bench_schedule(8, 40, seed=3)
    assert a == bench_schedule(8, 40, seed=3)
    assert a != bench_schedule(8, 40, seed=4)
    assert len(a) == 4 and len({f.replica for f in a}) == 4  # half of R, each replica once
    assert all(f.kind == "kill" and f.phase in PHASES for f in a)
    steps = [f.step for f in a]
    assert steps == sorted(steps) and steps[0] >= 1 and steps[-1] <= 38
    windows = [(1 + k * 38 // 4, 1 + (k + 1) * 38 // 4) for k in range(4)]
    assert all(lo <= s < hi for s, (lo, hi) in zip(steps, windows, strict=True))
    validate_faults([str(f) for f in a], 8, 40)  # valid `--fault` specs
    with pytest.raises(ConfigError):
        bench_schedule(4, 40, seed=0, kills=4)
    with pytest.raises(ConfigError):
        bench_schedule(8, 6, seed=0)


def test_remap_renames_survivors_and_drops_the_dead() -> None:
    faults = bench_schedule(8, 40, seed=1)
    dead = faults[0].replica
    alive = [r for r in range(8) if r != dead]
    new = remap(faults[1:], alive)
    assert [alive[f.replica] for f in new] == [f.replica for f in faults[1:]]
    assert all(f.replica < 7 for f in new)
    assert remap(faults, alive)[0].step == faults[1].step  # the dead one's fault is gone


def test_young_daly_interval() -> None:
    # sqrt(2 * C * MTBF) / step: C = 0.1 s, MTBF = 40 * 0.2 / 4 = 2 s -> 0.632 s -> 3 steps.
    assert young_daly_k(0.1, 0.2, 40, 4) == 3
    assert young_daly_k(0.1, 0.2, 40, 0) == 40  # no faults: only the final checkpoint
    assert young_daly_k(1e-6, 0.2, 40, 4) == 1


@pytest.mark.timeout(300)
def test_shrink_batch_discards_and_shrinks(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    # The reference is the session's failure-free R=4 run (equal quotas, as here).
    ref = ref4
    args = [*BASE, "--replicas", "4", "--dump-final-params"]
    run = recover_train(tmp_path / "run", *args, "--policy", "shrink-batch", "--fault",
                        "kill:replica=2,step=5,phase=backward", data=corpus)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(14))
    assert [r["microbatches"] for r in recs] == [8] * 5 + [6] * 9  # replica 2's ids are skipped
    assert recs[5]["attempts"] == 2 and recs[5]["recovered"] == []  # discarded, not recomputed
    assert all("2" not in r["quotas"] for r in recs[5:])
    assert max_rel(run.losses()[:5], ref.losses()[:5]) < 1e-5  # identical until the loss
    assert max_rel(run.losses(), ref.losses()) > 1e-4  # then it leaves the trajectory
    finals = run.finals()
    assert sorted(finals) == [0, 1, 3]
    assert all(bitwise_equal(finals[0], f) for f in finals.values())


@pytest.mark.timeout(300)
def test_abort_on_loss_tears_the_job_down(corpus: Path, tmp_path: Path) -> None:
    cfg = preset("debug")
    cfg.layout.replicas, cfg.run.steps, cfg.data.eval_every, cfg.data.path = 3, 10, 0, str(corpus)
    cfg.run.out = str(tmp_path / "run")
    cfg = cfg.replace(ft={"faults": ["kill:replica=1,step=4,phase=forward"]})
    res = launch(cfg, quiet=True, watch=AbortOnLoss)
    assert not res.ok and res.aborted == [1], res.message
    assert res.exit_codes[1] == -9 and all(c is not None for c in res.exit_codes.values())
    assert [r["step"] for r in res.records] == [0, 1, 2, 3]  # nothing recovered in place
    assert res.t_start < res.t_abort < time.time()
