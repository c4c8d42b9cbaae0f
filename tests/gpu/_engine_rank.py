"""One replica process of `test_cuda.py`: `StepEngine` steps on a flat gradient on --device.

Invariant: every microbatch id i adds (i mod N) + 1 to every element of the replica's gradient,
so a committed step's reduced gradient is exactly N(N+1)/2 everywhere (in fp32 and in bf16: the
integers involved are exact in both), whoever computed which id. The process records, per step,
the reduced gradient's min/max, its device and dtype, the verified microbatch count and the
recovery facts, as JSON in --result; replica --kill's process SIGKILLs itself right after
issuing its reduce of step --kill-step (a crash mid-reduce).

    python tests/gpu/_engine_rank.py --coordinator H:P --replica r --device cuda --result f.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

from recover.collectives import Member, connect
from recover.recovery import StepEngine
from recover.settings import FaultTolerance


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
    host, port = a.coordinator.rsplit(":", 1)
    member = Member(host, int(port), a.replica, ft=FaultTolerance(join_timeout_s=60.0))
    # gloo, on device tensors
    comm = connect(member, FaultTolerance(reduce_timeout_s=30.0), device=device)
    flat = torch.zeros(a.numel, dtype=getattr(torch, a.dtype), device=device)

    def hook(phase: str, step: int, j: int) -> None:
        if a.replica == a.kill and phase == "reduce" and step == a.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def compute(mb_id: int, j: int) -> float:
        flat.add_(mb_id % n + 1)
        return float(mb_id % n + 1)

    engine = StepEngine(member, comm, flat, n, timeout_s=30.0, hook=hook, speed_aware=False)
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
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # No teardown of a gloo group a dead peer left mid-operation (docs/MEASUREMENTS.md,
    # "gloo on CPU").
    os._exit(code)
