"""One rank's part in the run's checkpoints: resume, periodic saves, and the save on the way out.

Invariant: a step is written by the leader replica only (the lowest live one, as its rank 0 sees
it), and by all of that replica's ranks together: DCP's collective save runs on a process group of
the replica's ranks kept for checkpoints alone, so it never interleaves with the model's own
collectives, and the replica's rank 0 decides and tells its siblings, so the ranks of one replica
never disagree about whether to save. Two replicas that both believe they lead (a membership change
mid-save) write to their own temp folders and the first to publish wins (`ckpt_files`). Every
collective here is bounded by the group's timeout. A resumed rank loads into the layout that wrote
the checkpoint (same shards / tp / stages), or refuses.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recover.app import rundir
from recover.app.config import RunConfig
from recover.app.runtoken import run_token
from recover.app.train.checkpoint.files import find_latest
from recover.app.train.layout import RankModel
from recover.errors import CheckpointError

log = logging.getLogger(__name__)


# A checkpoint's `extra` entry of exact mode's agreed maxima (`ExactGrads.max_seen`), one list
# per rank of the replica: the next step's exponents, which the model and optimizer do not hold.
EXACT_MAX = "exact_max"


def layout_of(cfg: RunConfig) -> dict[str, Any]:
    """What a checkpoint records about the replica layout that wrote it (and a resume checks)."""
    lay = cfg.layout
    return {"layout": lay.name, "shards": lay.shards, "tp": lay.tp, "stages": lay.stages}


class RankCheckpoints:
    """Create on every rank of every replica, in the same order relative to other groups (for a
    multi-rank replica this builds a process group: a collective over the replica's ranks)."""

    def __init__(self, run_dir: Path, cfg: RunConfig, rm: RankModel,
                 optimizer: torch.optim.Optimizer) -> None:
        self.root, self.cfg, self.rm, self.opt = run_dir / rundir.CKPT, cfg, rm, optimizer
        self.key = run_token(run_dir)
        self.layout = layout_of(cfg)
        self.group: dist.ProcessGroup | None = None
        self.scope = ""
        self.exact_max: list[float] | None = None  # this rank's exact-mode maxima, resumed
        if cfg.layout.ranks_per_replica() > 1:
            self.group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=cfg.ft.reduce_timeout_s))
            if "pp" in cfg.layout.name.split(","):
                # Every stage names its blocks from 0: stage s's state lives under its own scope.
                self.scope = f"stage{rm.mesh.get_local_rank('pp')}"

    def resume(self) -> int:
        """Load the newest checkpoint that verifies; return its step (optimizer steps applied)."""
        path, skipped = find_latest(self.root, self.key)
        for line in skipped:
            log.warning(f"resume: {line}")
        if path is None:
            raise CheckpointError(f"--resume: no checkpoint in {self.root} verifies")
        from recover.app.train.checkpoint.dcp import load_checkpoint  # DCP: a slow import

        meta = load_checkpoint(path, self.rm.module, self.opt, key=self.key, group=self.group,
                               scope=self.scope, layout=self.layout)
        log.info(f"resumed from {path.name} at step {meta['step']}")
        per_rank = meta["extra"].get(EXACT_MAX)
        if isinstance(per_rank, list) and len(per_rank) == self.cfg.layout.ranks_per_replica():
            self.exact_max = [float(v) for v in per_rank[self._rank()]]
        return int(meta["step"])

    def _rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    def save(self, step: int, leader: bool, extra: dict[str, Any]) -> dict[str, Any]:
        """Every rank of every replica calls this at the same save point; the leader replica's
        ranks write `step`. `leader` counts on the replica's rank 0 only.

        Returns the save's outcome, for the step's metrics record: `{"ckpt": step}` once written;
        `{"ckpt_error": why}` if the storage refused it (a full disk, no permission, an I/O
        error: nothing published, no temp folder left, every rank of the replica agrees, and
        training goes on: a storage fault is not a replica fault); `{"ckpt_pending": True}` on a
        replica that does not write. Only a failure of the replica itself (a rank that died
        mid-save) is raised.
        """
        if self.group is not None:
            flag = torch.tensor([int(leader)], dtype=torch.int64)
            dist.broadcast(flag, group_src=0, group=self.group)
            leader = bool(flag[0])
        if not leader:
            return {"ckpt_pending": True}
        from recover.app.train.checkpoint.dcp import save_checkpoint

        if EXACT_MAX in extra:  # exact mode's exponents, every rank's: a resume goes on bitwise
            per_rank: list[Any] = [extra[EXACT_MAX]]
            if self.group is not None:
                per_rank = [None] * self.cfg.layout.ranks_per_replica()
                dist.all_gather_object(per_rank, extra[EXACT_MAX], group=self.group)
            extra = {**extra, EXACT_MAX: per_rank}

        try:
            save_checkpoint(self.root, step, self.rm.module, self.opt, extra, key=self.key,
                            group=self.group, scope=self.scope, layout=self.layout)
        except (CheckpointError, OSError) as e:
            why = " ".join(str(e).split())[:400]
            log.error(f"checkpoint at step {step} not saved (training goes on): {why}")
            return {"ckpt_error": why}
        return {"ckpt": step}

    def save_on_exit(self, step: int, leader: bool, extra: dict[str, Any]) -> dict[str, Any]:
        """`save`, when the run is stopping: nothing is raised (a sibling that never arrives is
        an `ckpt_error` too), so the process still ends with its own exit code."""
        try:
            return self.save(step, leader, extra)
        except Exception as e:
            why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            log.error(f"no checkpoint at step {step}: {why}")
            return {"ckpt_error": why}
