"""What the three examples share: their launch, their data, their training loop and its report.

Invariant: a microbatch is a pure function of its id (`batch`), so whichever replica computes it
gets the same data, and a recomputed microbatch is the lost one. Run an example with one
`torchrun` per replica, all pointed at one coordinator (here `hsdp.py`; `tp.py` and `pp.py` alike):

    recover coordinator --replicas 2 --port 29600 &
    for r in 0 1; do
      RECOVER_COORDINATOR=127.0.0.1:29600 RECOVER_REPLICA=$r \\
        torchrun --standalone --nproc-per-node 2 examples/hsdp.py &
    done; wait

Kill any one rank (`kill -9 PID`): its replica's other rank exits by itself (code 3), and the
other replica finishes the run with the same losses, recomputing the lost microbatches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recover import Replica, StepResult

log = logging.getLogger("example")
N, B, STEPS = 8, 8, 30  # microbatches per step, sequences per microbatch, steps


def batch(mb_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch `mb_id`: a pure function of the id (whoever computes it gets the same data)."""
    g = torch.Generator().manual_seed(mb_id)
    x = torch.randn(B, 32, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True)).expand(B, 32)


def start(dim: str) -> DeviceMesh:
    """This replica's process group (its ranks only: one torchrun per replica) and 1-D mesh."""
    # recover's own lines (joins, recoveries, fencing) come through the same handler.
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(dim,))
    torch.manual_seed(0)  # every rank builds the same model
    return mesh


def report(rep: Replica, step: int, res: StepResult) -> None:
    """One line per step from the replica's rank 0: the step's mean loss and who is live."""
    if dist.get_rank() == 0:
        log.info(f"replica {rep.replica} step {step} loss {res.loss:.6f} "
                 f"live replicas {res.members}")


def train(rep: Replica, opt: torch.optim.Optimizer,
          loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """An ordinary gradient-accumulation loop over N microbatches a step, with recover's lines:
    the same for any layout inside a replica (FSDP2 here, TP, ...): only `loss_of` differs."""
    for step in range(STEPS):
        def compute(mb_id: int, j: int) -> float:  # recover (was: for mb_id in step's N ids:)
            x, y = batch(mb_id)
            loss = loss_of(x, y)
            (loss / N).backward()
            return loss.item()  # recover

        res = rep.step(step, compute)  # recover: my ids, fault-tolerant reduce, agreed commit
        rep.clip_grad_norm_(1.0)  # recover: (was torch.nn.utils.clip_grad_norm_)
        opt.step()
        opt.zero_grad()
        report(rep, step, res)
