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
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("plain")
EPOCHS, BATCH = int(os.environ.get("EPOCHS", 3)), 16


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
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # on a GPU: "cuda", fp16 autocast
    data = Points()
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)

    model.train()
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if dist.get_rank() == 0:
            path = os.path.join(os.environ.get("SNAPSHOTS", "."), f"snapshot_{epoch}.pt")
            torch.save(model.state_dict(), path)
            log.info(f"epoch {epoch} loss {loss:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
