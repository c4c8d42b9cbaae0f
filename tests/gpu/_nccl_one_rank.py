"""The NCCL path of `FaultTolerantComm` with one rank on one GPU (for `test_cuda.py`).

Invariant: prints one JSON object (the facts the test judges) as its last stdout line. With one
member, `reduce_` skips the collective, so this exercises what a reduce over several GPUs runs,
step by step, through the communicator's own (private) parts, test-only: the abandonable build
(store barrier, `ProcessGroupNCCL` made in a helper thread and eagerly connected to the device
there), an all-reduce known complete only through a CUDA event recorded after it (polled from
the host; no result read before), and the abort of a communicator with an operation in flight,
after which no buffer is reported in use (NCCL, unlike gloo, ends operations on abort).

    python tests/gpu/_nccl_one_rank.py --coordinator H:P
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from recover.collectives import connect
from recover.control import Member
from recover.procs import exit_after
from recover.settings import FaultTolerance, Numerics


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--numel", type=int, default=1 << 22)
    a = ap.parse_args()
    host, port = a.coordinator.rsplit(":", 1)
    ft = FaultTolerance(join_timeout_s=60.0, reduce_timeout_s=60.0)
    member = Member(host, int(port), 0, ft=ft)
    dev = torch.device("cuda", 0)
    comm = connect(member, ft, Numerics(backend="nccl"), device=dev)
    out: dict[str, object] = {}
    g = member.generation()
    members = member.members(g)
    # 1. The public call: one member, no collective; the tensor is left as it is.
    x = torch.full((1024,), 3.0, device=dev)
    comm.reduce_([x], g)
    out["one_member_reduce_ok"] = bool((x == 3.0).all())
    # 2. The build reduce_ runs for several members: barrier, then the NCCL group made and
    # eagerly connected in the abandonable build thread.
    t0 = time.monotonic()
    pg = comm._group(g, members)
    out["build_s"] = time.monotonic() - t0
    out["pg_type"] = type(pg).__name__
    out["stats"] = dict(comm.stats)
    # 3. A collective whose completion is a CUDA event recorded after it.
    y = torch.arange(a.numel, dtype=torch.float32, device=dev)
    works = [pg.allreduce([y])]
    done = comm._completion(works)
    polls, deadline = 0, time.monotonic() + 60.0
    while not done() and time.monotonic() < deadline:
        polls += 1
        time.sleep(0.0005)
    out["completed"] = bool(done())
    out["polls"] = polls
    want = torch.arange(a.numel, dtype=torch.float32, device=dev)  # the sum over one rank
    out["allreduce_exact"] = bool(torch.equal(y, want))
    # 4. Abort with an operation in flight: NCCL ends it; nothing is held for the buffer.
    z = torch.ones(a.numel, device=dev)
    works = [pg.allreduce([z])]
    comm._abandon(pg, [w.get_future() for w in works], [z])
    out["in_use_after_abort"] = comm.in_use(z)
    out["group_dropped"] = comm._pg is None
    print(json.dumps(out), flush=True)
    member.leave()
    return 0


if __name__ == "__main__":
    exit_after(main)  # an aborted NCCL communicator must not be destroyed at interpreter exit
