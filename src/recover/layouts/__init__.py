"""Replica layouts: how a replica's internal parallelism exposes its local gradient to layer 2.

A replica is plain (one process), an FSDP2 shard group (`hsdp`), a tensor-parallel group (`tp`), a
pipeline (`pp`), or both (`tp,pp`). Public API: `ShardedGrads` (local gradient shards of
DTensor/stage parameters); `FlatGrads`, `flat_grad_buffer` (plain); `init_replica_group`,
`replica_mesh`, `ranks_per_replica`, `LAYOUTS`. Model-agnostic layout pieces:
`recover.layouts.hsdp` (FSDP2 over a shard group, a shard's rows) and `.pp` (a GPipe schedule over
any stage module); a model's own parallelize plans live with the model (the reference GPT's:
`recover.app.train.parallelize`). The `Replica` that drives any of them is `recover.replica`.

Invariant: a layout knows nothing of membership or recovery: it hands the step engine one
rank's local gradient, and nothing in it imports `recover.replica`.

Names are imported lazily: the plain layout never pays for importing DTensor and FSDP2 (seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

from recover.layouts.plain import FlatGrads, flat_grad_buffer

_LAZY = {"ShardedGrads": "sharded", "LAYOUTS": "mesh", "init_replica_group": "mesh",
         "ranks_per_replica": "mesh", "replica_mesh": "mesh"}

__all__ = ["LAYOUTS", "FlatGrads", "ShardedGrads", "flat_grad_buffer", "init_replica_group",
           "ranks_per_replica", "replica_mesh"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"recover.layouts.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'recover.layouts' has no attribute {name!r}")
