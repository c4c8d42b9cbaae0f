"""Replica layouts: how a replica's internal parallelism exposes its local gradient to layer 2.

A replica is plain (one process), an FSDP2 shard group (`hsdp`), a tensor-parallel group (`tp`), a
pipeline (`pp`), or both (`tp,pp`). Public API: `Replica` (join, `step`, `clip_grad_norm_`,
`leave`; `epochs`: an epoch-style loop over its steps, `Epochs`) for any layout; `ShardedGrads`
(local gradient shards of DTensor/stage parameters);
`FlatGrads`, `flat_grad_buffer` (plain); `init_replica_group`, `replica_mesh`,
`ranks_per_replica`; `connect_rank` (`recover.parallel.rank`: the one wiring of a rank's
member, communicator and step engine). Model-agnostic layout pieces: `recover.parallel.hsdp`
(FSDP2 over a shard group, a shard's rows) and `.pp` (a GPipe schedule over any stage module);
a model's own parallelize plans live with the model (the reference GPT's:
`recover.app.train.parallelize`).

Names are imported lazily: the plain layout never pays for importing DTensor and FSDP2 (seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

from recover.parallel.plain import FlatGrads, flat_grad_buffer

_LAZY = {"Replica": "replica", "Epochs": "epochs", "ShardedGrads": "grads", "LAYOUTS": "mesh",
         "RankStack": "rank", "connect_rank": "rank", "new_member": "rank",
         "init_replica_group": "mesh", "ranks_per_replica": "mesh", "replica_mesh": "mesh"}

__all__ = ["LAYOUTS", "Epochs", "FlatGrads", "RankStack", "Replica", "ShardedGrads", "connect_rank",
           "flat_grad_buffer", "init_replica_group", "new_member", "ranks_per_replica",
           "replica_mesh"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"recover.parallel.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'recover.parallel' has no attribute {name!r}")
