"""CUDA tensors, NCCL and the GPU trainer, written so that ONE GPU suffices (CI has none: skipped).

- Several replica processes share cuda:0 and reduce CUDA gradients over gloo (which accepts
  device tensors); one is SIGKILLed mid-reduce; the survivors' reduced gradient must be exactly
  the expected sum, in fp32 and bf16.
- NCCL needs one GPU per rank, so with one GPU it runs with one rank: `reduce_` then skips the
  collective, and `_nccl_one_rank.py` drives the steps a multi-GPU reduce takes (the abandonable
  build with eager connect, event-based completion, abort) through the communicator's own parts.
- `recover train --device cuda --dtype bf16` with a kill stays within the bf16 tolerance of its
  failure-free reference (docs/DESIGN.md, "The invariant and its tolerances"); `--exact` on CUDA is
  bitwise its reference.

Every process is started by harness.processes and ended by its PID.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import oracle
from harness.processes import Proc, stop_all
from harness.runs import recover_train

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False); CI has none"),
    pytest.mark.timeout(600),
]

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
N = 8
# bf16 autocast's grouping noise floor is 8.2e-4 .. 1.2e-3 (docs/MEASUREMENTS.md,
# "Loss tolerances").
BF16_TOL = 5e-3


def coordinator(tmp: Path, replicas: int, procs: list[Proc]) -> str:
    port_file = tmp / "coordinator.port"
    procs.append(Proc("coordinator", "recover.control.coordinator:main",
                      ["--replicas", str(replicas), "--host", "127.0.0.1", "--port", "0",
                       "--port-file", str(port_file), "--stale-s", "5"], tmp, ENV))
    deadline = time.monotonic() + 90
    while not port_file.exists():
        assert procs[-1].alive() and time.monotonic() < deadline, procs[-1].stderr()
        time.sleep(0.05)
    return f"127.0.0.1:{int(port_file.read_text())}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gloo_on_cuda_tensors_recovers_a_kill(tmp_path: Path, dtype: str) -> None:
    # 3 replicas: after the kill, the 2 survivors' redo is a real collective.
    procs: list[Proc] = []
    try:
        addr = coordinator(tmp_path, 3, procs)
        reps = [Proc.command(f"replica{r}", [sys.executable, str(HERE / "_engine_rank.py"),
                                             "--coordinator", addr, "--replica", str(r),
                                             "--device", "cuda", "--dtype", dtype, "--kill", "2",
                                             "--result", str(tmp_path / f"r{r}.json")],
                             tmp_path, ENV)
                for r in range(3)]
        procs += reps
        for r in (0, 1):
            assert reps[r].wait(240) == 0, reps[r].stderr()[-3000:]
        assert reps[2].wait(30) == -9  # SIGKILLed mid-reduce
    finally:
        stop_all(procs)
    for r in (0, 1):
        steps = json.loads((tmp_path / f"r{r}.json").read_text())
        assert [s["step"] for s in steps] == [0, 1, 2, 3]
        for s in steps:  # the exact sum over all N ids, on the GPU, in the gradient's dtype
            assert s["min"] == s["max"] == oracle.expected(s["step"], N), s
            assert s["microbatches"] == N and s["loss"] == oracle.expected_loss(s["step"], N), s
            assert s["device"] == "cuda:0" and s["dtype"] == f"torch.{dtype}", s
        assert steps[2]["attempts"] >= 2 and steps[2]["recovered"], steps[2]
        assert steps[3]["members"] == [0, 1]


def test_nccl_one_rank_build_event_completion_abort(tmp_path: Path) -> None:
    procs: list[Proc] = []
    try:
        addr = coordinator(tmp_path, 1, procs)
        p = Proc.command("nccl", [sys.executable, str(HERE / "_nccl_one_rank.py"),
                                  "--coordinator", addr], tmp_path, ENV)
        procs.append(p)
        assert p.wait(240) == 0, p.stderr()[-3000:]
    finally:
        stop_all(procs)
    out = json.loads(p.stdout().strip().splitlines()[-1])
    assert out["one_member_reduce_ok"]
    assert out["pg_type"] == "ProcessGroupNCCL" and out["stats"]["build_s"] > 0, out
    assert out["completed"] and out["allreduce_exact"], out
    assert out["in_use_after_abort"] is False and out["group_dropped"], out


def _last(stdout: str, key: str) -> str:
    line = next(x for x in reversed(stdout.strip().splitlines()) if x.startswith(key + "="))
    return line.split("=", 1)[1]


TRAIN = ["--preset", "debug", "--device", "cuda", "--steps", "10", "--replicas", "3",
         "--eval-every", "0", "--fault", "kill:replica=2,step=4,phase=reduce", "--reference"]


def test_train_bf16_on_cuda_with_a_kill(corpus: Path, tmp_path: Path) -> None:
    run = recover_train(tmp_path / "run", *TRAIN, "--dtype", "bf16", data=corpus, timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(10))
    assert all(r["microbatches"] == N for r in recs)  # under bf16, the proof nothing was lost
    assert recs[-1]["live_replicas"] == 2 and recs[4]["recovered"]
    assert float(_last(run.stdout, "max_rel_loss_diff")) <= BF16_TOL


def test_train_exact_on_cuda_is_bitwise_its_reference(corpus: Path, tmp_path: Path) -> None:
    run = recover_train(tmp_path / "run", *TRAIN, "--exact", data=corpus, timeout=540)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _last(run.stdout, "max_rel_loss_diff") == "0"
    assert "final_params_bitwise_equal=true" in run.stdout
