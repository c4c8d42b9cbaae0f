"""Two ranks of one hsdp replica (FSDP2, 2 shards) checkpointing together while the storage fails
on one of them: the processes of tests/test_storage_faults.py.

Forked by that test as `main([RUN_DIR, PORT, RANK, FAULT])` (the session's spawner: torch already
imported). Each rank saves step 1 (the storage works), step 2 with FAULT injected in this process
only, step 2 again (it works again), and step 3 as a run that stops does (`save_on_exit`) with
FAULT again, through the trainer's own `RankCheckpoints`; it writes
what each save returned, and what the checkpoint folder held after the failed one, to
RUN_DIR/rank{RANK}.json. FAULT: `data:R` (rank R's DCP data file hits ENOSPC at its fsync) or
`manifest:R` (rank R's meta.json hits ENOSPC, after every rank's DCP write succeeded).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from recover.app.config import preset
from recover.app.train.checkpoint import files as ckpt_files
from recover.app.train.checkpoint.ranks import RankCheckpoints
from recover.app.train.layout import RankModel
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer
from recover.app.train.parallelize import fully_shard_gpt
from recover.layouts import replica_mesh


def _enospc(*_: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@contextmanager
def storage_fault(fault: str, rank: int, fired: list[int]) -> Iterator[None]:
    """FAULT's failure in this process if it names this rank; `fired` counts the failed calls."""
    kind, target = fault.split(":")
    if int(target) != rank:
        yield
        return
    # fsync is where a full disk shows for data already written (delayed allocation, NFS).
    where = {"data": (os, "fsync"), "manifest": (ckpt_files, "write_manifest")}[kind]

    def fail(*args: object) -> None:
        fired.append(1)
        _enospc()

    with mock.patch.object(*where, side_effect=fail):
        yield


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, port, rank, fault = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    cfg = preset("debug")
    cfg.layout.name, cfg.layout.shards, cfg.layout.replicas = "hsdp", 2, 1
    model = build_model(cfg.model, cfg.run.seed)
    mesh = replica_mesh("hsdp", 2)
    fully_shard_gpt(model, mesh)
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size),
                      generator=torch.Generator().manual_seed(rank))
    model(x, x)[1].backward()
    opt.step()  # AdamW state exists: the saves hold it too
    ckpts = RankCheckpoints(run_dir, cfg, RankModel(model, model, mesh), opt)
    out: dict[str, Any] = {"first": ckpts.save(1, rank == 0, {})}
    fired: list[int] = []
    with storage_fault(fault, rank, fired):
        out["failed"] = ckpts.save(2, rank == 0, {})
    out["fired"] = len(fired)
    dist.barrier()  # what the folder holds once every rank is past the failed save
    out["after"] = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    out["latest"] = (run_dir / "ckpt" / "latest").read_text().strip()
    out["retried"] = ckpts.save(2, rank == 0, {})
    fired.clear()
    with storage_fault(fault, rank, fired):  # the save on the way out (below min_replicas)
        out["on_exit"] = ckpts.save_on_exit(3, rank == 0, {})
    out["fired_on_exit"] = len(fired)
    (run_dir / f"rank{rank}.json").write_text(json.dumps(out))
    return 0
