"""What the three examples share: their launch, their data, their training loop and its report.

Invariant: a microbatch is a pure function of its id (`batch`: `recover.data.IdBatches` over a
map-style dataset, every item once per epoch), so whichever replica computes it gets the same
data, and a recomputed microbatch is the lost one. Run an example with one
`torchrun` per replica, all pointed at one coordinator (here `hsdp.py`; `tp.py` and `pp.py` alike):

    recover coordinator --replicas 2 --port 29600 --exit-when-done &
    for r in 0 1; do
      RECOVER_COORDINATOR=127.0.0.1:29600 RECOVER_REPLICA=$r \\
        torchrun --standalone --nproc-per-node 2 examples/hsdp.py &
    done; wait

Kill any one rank (`kill -9 PID`): its replica's other rank exits by itself (code 3), and the
other replica finishes the run with the same losses, recomputing the lost microbatches.
`--exit-when-done` ends the coordinator once every replica has left or been lost, so `wait`
returns (without it the coordinator stays up for replicas still to come).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recover import Replica, StepResult
from recover.data import IdBatches

log = logging.getLogger("example")
N, B, STEPS = 8, 8, 30  # microbatches per step, samples per microbatch, steps


class Points:
    """A map-style dataset (`__len__`, `__getitem__`): put yours here. Point i is a fixed input in
    R^32 and its target. For `recover prepare`'s token shards use
    `IdBatches.from_prepared(DIR, block_size, B, seed)` instead: (x, y) token windows."""

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, generator=torch.Generator().manual_seed(i))
        return x, torch.sin(x.sum()).expand(32)


DATA = IdBatches(Points(), B, seed=0)  # id -> B points; every point once per epoch of 128 ids


def batch(mb_id: int, rank: int = 0, ranks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatch `mb_id` (rank `rank` of `ranks` that split its rows: its block of them): a
    pure function of the id, whoever computes it."""
    return DATA.batch(mb_id, rank, ranks)


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
          loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          part: tuple[int, int] = (0, 1)) -> None:
    """An ordinary gradient-accumulation loop over N microbatches a step, with recover's lines:
    the same for any layout inside a replica (FSDP2 here, TP, ...): only `loss_of` differs, and
    `part`, the (rank, ranks) that split each microbatch's rows (FSDP2's shards)."""
    for step in range(STEPS):
        def compute(mb_id: int, j: int) -> float:  # recover (was: for mb_id in step's N ids:)
            x, y = batch(mb_id, *part)
            loss = loss_of(x, y)
            (loss / N).backward()
            return loss.item()  # recover

        res = rep.step(step, compute)  # recover: my ids, fault-tolerant reduce, agreed commit
        rep.clip_grad_norm_(1.0)  # recover: (was torch.nn.utils.clip_grad_norm_)
        opt.step()
        opt.zero_grad()
        report(rep, step, res)
