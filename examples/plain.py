"""A small trainer with dropout, a GradScaler, a DataLoader over a map-style dataset and a snapshot
per epoch, in two forms: examples/ddp_original.py is plain DDP (`torchrun --nproc-per-node 4`),
examples/plain.py the same ported to recover (one `torchrun` per replica); docs/porting.md
compares the two line by line and launches each.

Invariant: every process holds the same parameters after every step: the same initial weights,
then the same mean gradient over the step's batches. DDP broadcasts rank 0's weights and averages
the gradients in backward. recover checks the weights at join, and makes a microbatch's items and
dropout functions of its id and a step's gradient the sum over its N ids / N, whoever computed
them: a replica killed mid-run changes nothing but who computes what.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn
from torch.utils.data import Dataset

from recover import Replica
from recover.data import IdBatches

log = logging.getLogger("plain")
EPOCHS, BATCH = int(os.environ.get("EPOCHS", 3)), 16
N = 4  # microbatches per step: DDP's world size (x accumulation steps), now a constant


class Points(Dataset):
    """A map-style dataset: put yours here."""

    def __len__(self) -> int:
        return 65536

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(32, generator=torch.Generator().manual_seed(i))
        return x, torch.sin(x.sum()).unsqueeze(0)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # on a GPU: "cuda", fp16 autocast
    data = Points()
    batches = IdBatches(data, BATCH, seed=0)  # microbatch id -> BATCH items, each once an epoch
    rep = Replica(model, N, optimizer=opt, data=batches, state={"scaler": scaler})

    def compute(mb_id: int, j: int) -> float:  # one microbatch: was the loader loop's body
        x, y = batches.batch(mb_id)
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss / N).backward()
        return loss.item()

    model.train()
    for epoch, steps in rep.epochs(EPOCHS):  # from a joiner's start_step on
        for step in steps:
            loss = rep.step(step, compute).loss  # my ids, fault-tolerant reduce, agreed commit
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if rep.is_leader:
            path = os.path.join(os.environ.get("SNAPSHOTS", "."), f"snapshot_{epoch}.pt")
            torch.save(model.state_dict(), path)
            log.info(f"epoch {epoch} loss {loss:.6f}")


if __name__ == "__main__":
    main()
