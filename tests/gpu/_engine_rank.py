"""One replica process of `test_cuda.py`: `StepEngine` steps on a flat gradient on --device.

Invariant: every microbatch id i adds the integer-gradient oracle's weight(i) to every element
of the replica's gradient (`harness.oracle`), so a committed step's reduced gradient is
exactly `oracle.expected(step, N)` everywhere (in fp32 and in bf16: for the 4 steps of 8 ids run
here every sum stays below 256, exact in both), whoever computed which id. The process records,
per step, the reduced gradient's min/max, its device and dtype, the verified microbatch count
and the recovery facts, as JSON in --result; replica --kill's process SIGKILLs itself right after
issuing its reduce of step --kill-step (a crash mid-reduce).

    python tests/gpu/_engine_rank.py --coordinator H:P --replica r --device cuda --result f.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch

from harness import oracle
from recover.procs import exit_after
from recover.replica.rank import connect_rank, new_member
from recover.settings import FaultTolerance, Hooks, LaunchEnv, ReplicaConfig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--kill", type=int, default=-1, help="replica killed mid-reduce")
    ap.add_argument("--kill-step", type=int, default=2)
    ap.add_argument("--result", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    n = a.microbatches
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device(a.device)
    flat = torch.zeros(a.numel, dtype=getattr(torch, a.dtype), device=device)
    config = ReplicaConfig(coordinator=a.coordinator, replica=a.replica, launch=LaunchEnv(),
                           ft=FaultTolerance(join_timeout_s=60.0, reduce_timeout_s=30.0,
                                             speed_aware=False))

    def hook(phase: str, step: int, j: int) -> None:
        if a.replica == a.kill and phase == "reduce" and step == a.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def compute(mb_id: int, j: int) -> float:
        oracle.add(flat, mb_id)
        return oracle.loss(mb_id)

    # gloo, on device tensors
    stack = connect_rank(new_member(config), flat, n, config, hooks=Hooks(at_phase=hook))
    member, engine = stack.member, stack.engine
    steps = []
    for t in range(a.steps):
        flat.zero_()
        res = engine.run(t, compute)
        steps.append({"step": t, "min": float(flat.min()), "max": float(flat.max()),
                      "device": str(flat.device), "dtype": str(flat.dtype),
                      "microbatches": res.microbatches, "loss": res.loss,
                      "attempts": res.attempts, "recovered": res.recovered,
                      "members": res.members})
    Path(a.result).write_text(json.dumps(steps))
    member.leave()
    return 0


if __name__ == "__main__":
    exit_after(main)
