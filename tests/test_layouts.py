"""Multi-rank replicas (recover.layouts): HSDP, TP and PP replicas, real processes on CPU gloo.

Failure-free, each layout follows the same trajectory as torch's native HSDP (for hsdp) or a
single-process run (tp, pp): losses within relative 1e-5 at every step. With one rank of one
replica SIGKILLed, the run finishes, matches its failure-free reference, and the dead rank's
siblings exit on their own (fenced: exit code 3, before the launcher's cleanup could end them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.processes import session
from harness.runs import (
    LAYOUT_ARGS,
    LAYOUT_FLAGS,
    LAYOUT_STEPS,
    Run,
    bitwise_equal,
    free_ports,
    max_rel,
    recover_train,
    rel_l2,
)
from recover.app import rundir
from recover.procs import Process

pytestmark = pytest.mark.timeout(300)
N, STEPS = 8, LAYOUT_STEPS
ARGS = [*LAYOUT_ARGS, "--dump-final-params"]
LAYOUT = LAYOUT_FLAGS


def train(out: Path, corpus: Path, *args: str) -> Run:
    run = recover_train(out, *ARGS, "--replicas", "2", *args, data=corpus)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert all(r["microbatches"] == N for r in recs)
    return run


def rank_final(run: Run, replica: int, rank: int) -> dict:
    import torch

    return torch.load(run.out / rundir.FINAL / f"replica{replica}.rank{rank}.pt", weights_only=True)


def exit_codes(run: Run) -> dict[str, int]:
    return json.loads((run.out / rundir.EXIT_CODES).read_text())


@pytest.fixture(scope="module")
def single(single_replica: Run) -> Run:
    """The single-process reference: one plain replica computes all N microbatches."""
    return single_replica


@pytest.fixture(scope="module")
def refs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Failure-free 2-replica runs of each layout (2 ranks per replica), started lazily."""
    return _Lazy(corpus, tmp_path_factory)


class _Lazy(dict):
    def __init__(self, corpus: Path, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.corpus, self.factory = corpus, factory

    def __missing__(self, layout: str) -> Run:
        run = train(self.factory.mktemp(f"ref-{layout.replace(',', '')}") / "run", self.corpus,
                    *LAYOUT[layout])
        assert all(r["live_replicas"] == 2 for r in run.metrics())
        finals = [rank_final(run, 1, k) for k in range(2)]
        assert all(bitwise_equal(rank_final(run, 0, k), finals[k]) for k in range(2)), \
            "replicas diverged"
        self[layout] = run
        return run


def native_hsdp(run_dir: Path, out: Path, timeout: float = 240) -> list[float]:
    """torch's native HSDP (FSDP2, 2x2 mesh) in 4 processes, on run_dir's config and data: forked
    with torchrun's environment, or under torchrun itself where there is no fork server."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = session()
    if not server.fork:
        return _native_hsdp_torchrun(run_dir, out, env, timeout)
    port = free_ports(1)  # for rank 0's store
    ranks: list[Process] = []
    try:
        for rank in range(4):
            env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4",
                         LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = out.parent / f"native{rank}.log"
            ranks.append(server.start("_native_hsdp:main", [str(run_dir), str(out)], log,
                                      env=env_r))
        deadline = time.monotonic() + timeout
        for rank, p in enumerate(ranks):
            code = p.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, (out.parent / f"native{rank}.log").read_text()[-3000:]
    finally:
        for p in ranks:  # by PID, through the server (a no-op for those that exited)
            p.kill()
            p.wait(30)
    return json.loads(out.read_text())


def _native_hsdp_torchrun(run_dir: Path, out: Path, env: dict[str, str],
                          timeout: float) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(Path(__file__).parent / "_native_hsdp.py"), str(run_dir), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
        raise AssertionError(f"native HSDP timed out:\n{output[-3000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, output[-3000:]
    return json.loads(out.read_text())


def test_hsdp_matches_native_hsdp(refs: dict[str, Run], tmp_path: Path) -> None:
    ours = refs["hsdp"]
    native = native_hsdp(ours.out, tmp_path / "native.json")
    assert len(native) == STEPS
    assert max_rel(ours.losses(), native) < 1e-5


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_layout_matches_single_process(refs: dict[str, Run], single: Run, layout: str) -> None:
    assert max_rel(refs[layout].losses(), single.losses()) < 1e-5


@pytest.mark.parametrize(("layout", "fault", "killed"), [
    # a shard rank of an HSDP replica, in backward (default rank: the replica's last)
    ("hsdp", "kill:replica=1,step=3,phase=backward", 1),
    # TP rank 0, while the cross-replica reduce is in flight (positions may split)
    ("tp", "kill:replica=1,step=3,phase=reduce,rank=0", 0),
    # the first stage of a pipeline, when its backward starts
    ("pp", "kill:replica=1,step=3,phase=backward,rank=0", 0),
])
def test_kill_one_rank(refs: dict[str, Run], corpus: Path, tmp_path: Path, layout: str,
                       fault: str, killed: int) -> None:
    ref = refs[layout]
    run = train(tmp_path / "run", corpus, *LAYOUT[layout], "--fault", fault)
    recs = run.metrics()
    assert max_rel(run.losses(), ref.losses()) < 1e-5
    assert recs[2]["live_replicas"] == 2 and recs[-1]["live_replicas"] == 1
    if "phase=reduce" not in fault:  # (a reduce that completed everywhere may commit in gen 0)
        assert recs[3]["generation"] == 1 and recs[3]["quotas"] == {"0": N}
        assert recs[3]["recovered"], "replica 1's microbatches of step 3 were recomputed"
    codes = exit_codes(run)
    sibling = 1 - killed
    assert codes[f"replica1.rank{killed}"] == -signal.SIGKILL, codes
    # fenced: left by itself, not ended by the launcher
    assert codes[f"replica1.rank{sibling}"] == 3, codes
    assert codes["replica0.rank0"] == 0 and codes["replica0.rank1"] == 0, codes
    log = (run.out / rundir.LOGS / (f"replica1.rank{killed}.log" if killed else "replica1.log"))
    assert "injecting kill" in log.read_text()
    for k in range(2):  # the survivor's shards/stages: the reference's, up to summation order
        assert rel_l2(rank_final(run, 0, k), rank_final(ref, 0, k)) < 1e-4


def test_sigterm_to_one_rank_is_the_replicas_planned_leave(refs: dict[str, Run], corpus: Path,
                                                          tmp_path: Path) -> None:
    # A scheduler's SIGTERM reaches a replica's ranks at different moments; here it reaches only
    # replica 1's rank 1, in step 3's backward. Both ranks agree to leave after step 3 (its
    # closing intra-replica sum), exit 0: a planned leave, nothing recomputed, no crash.
    ref = refs["hsdp"]
    run = train(tmp_path / "run", corpus, *LAYOUT["hsdp"], "--fault",
                "preempt:replica=1,step=3,phase=backward,rank=1")
    recs = run.metrics()
    assert max_rel(run.losses(), ref.losses()) < 1e-5
    assert recs[3]["members"] == [0, 1] and recs[3]["recovered"] == [], recs[3]
    # step 4 was planned (implied) for both before the leave was seen: its ids for replica 1,
    # never computed anywhere, moved to replica 0 (a second attempt, nothing computed twice)
    assert recs[4]["members"] == [0], recs[4]
    assert exit_codes(run) == {f"replica{r}.rank{k}": 0 for r in range(2) for k in range(2)}
    exits = json.loads((run.out / rundir.REPLICA_EXITS).read_text())
    assert exits["1"].endswith("coordinator: left cleanly (preempted)"), exits
    assert "injecting preempt" in (run.out / rundir.LOGS / "replica1.rank1.log").read_text()


# -- pieces, without processes ---------------------------------------------------------------
def test_qkv_order_gives_each_tp_rank_its_own_heads() -> None:
    import torch

    from recover.app.train.parallelize import qkv_order, unpermute_state_dict

    c, tp = 8, 2
    rows = torch.arange(3 * c)  # row i of the fused [q; k; v] weight
    block = rows[qkv_order(c, tp)].view(tp, 3, c // tp)  # rank r's block, split in 3 like forward
    for r in range(tp):
        for part in range(3):  # q, k, v of heads r*h/tp .. (r+1)*h/tp
            assert block[r, part].tolist() == list(range(part * c + r * c // tp,
                                                         part * c + (r + 1) * c // tp))
    w = torch.randn(3 * c, c)
    sd = {"blocks.0.attn.c_attn.weight": w[qkv_order(c, tp)], "x": w}
    back = unpermute_state_dict(sd, c, tp)
    assert torch.equal(back["blocks.0.attn.c_attn.weight"], w) and torch.equal(back["x"], w)


def test_stages_cover_every_layer_once() -> None:
    from recover.layouts.pp import stage_blocks

    for layers in range(1, 7):
        for stages in range(1, layers + 1):
            got = [i for s in range(stages) for i in stage_blocks(layers, stages, s)]
            assert got == list(range(layers))
    with pytest.raises(ValueError):
        stage_blocks(2, 3, 0)


def test_sharded_grads_round_trip() -> None:
    import torch
    from torch import nn

    from recover.layouts.sharded import ShardedGrads

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    g = ShardedGrads(model.parameters())
    out = torch.full((g.numel,), 7.0)
    g.pack(out)
    assert torch.equal(out, torch.zeros(g.numel))  # no gradient yet: zeros
    flat = torch.arange(g.numel, dtype=torch.float32)
    g.assign(flat)
    g.pack(out)
    assert torch.equal(out, flat)
    assert torch.equal(model[0].weight.grad.view(-1), flat[:12])
    g.zero()
    assert all(p.grad is None for p in model.parameters())


def test_fault_rank_defaults_to_the_last() -> None:
    from recover.app.faults import FaultInjector, validate_faults
    from recover.errors import ConfigError

    faults = validate_faults(["kill:replica=1,step=2", "hang:replica=0,step=1,seconds=1,rank=0"],
                             replicas=2, steps=5, nranks=2)
    assert [len(FaultInjector(faults, 1, k, 2).faults) for k in range(2)] == [0, 1]
    assert [len(FaultInjector(faults, 0, k, 2).faults) for k in range(2)] == [1, 0]
    assert "rank=0" in str(faults[1])
    with pytest.raises(ConfigError, match="rank 2 does not exist"):
        validate_faults(["kill:replica=0,step=1,rank=2"], replicas=2, steps=5, nranks=2)
