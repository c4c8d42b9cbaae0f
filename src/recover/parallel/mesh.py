"""A replica's own process group and device mesh.

Invariant: the ranks of one replica, and only they, form a default process group, so FSDP2, DTensor
and pipelining (which use the default group) never reach across replicas; everything that crosses
replicas goes through recover's fault-tolerant communicators. `recover train` builds that group on
the coordinator's store under the prefix `replica{r}/pg`; under `torchrun` (one per replica) the
user's usual `init_process_group()` does the same job. The mesh's row-major rank order is the
rank's position: with ("pp", "tp"), rank = pp * tp_size + tp.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import PrefixStore
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recover.collectives import connect_store
from recover.settings import LaunchEnv

# The replica layouts recover knows how to reduce (one definition; the app offers these choices).
LAYOUTS = ("plain", "hsdp", "tp", "pp", "tp,pp")


def ranks_per_replica(layout: str, shards: int = 1, tp: int = 1, stages: int = 1) -> int:
    """How many processes one replica of `layout` has."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    return {"plain": 1, "hsdp": shards, "tp": tp, "pp": stages, "tp,pp": tp * stages}[layout]


def replica_mesh(layout: str, shards: int = 1, tp: int = 1, stages: int = 1) -> DeviceMesh | None:
    """The replica's mesh over its default group (None for plain)."""
    shape = {"plain": None, "hsdp": ((shards,), ("shard",)), "tp": ((tp,), ("tp",)),
             "pp": ((stages,), ("pp",)), "tp,pp": ((stages, tp), ("pp", "tp"))}[layout]
    if shape is None:
        return None
    return init_device_mesh("cpu", shape[0], mesh_dim_names=shape[1])


def init_replica_group(host: str, port: int, replica: int, rank: int, nranks: int,
                       timeout_s: float = 60.0, incarnation: str | None = None) -> None:
    """The replica's default process group, on the coordinator's store (prefix per replica).

    `incarnation` (default: the launcher's, `LaunchEnv.incarnation`): a restarted replica builds
    its group afresh under a new prefix, since its earlier incarnation's keys are stale.
    """
    inc = LaunchEnv.from_env().incarnation if incarnation is None else incarnation
    store = connect_store(host, port, timeout_s)
    dist.init_process_group("gloo", store=PrefixStore(f"replica{replica}.{inc}/pg", store),
                            rank=rank,
                            world_size=nranks, timeout=datetime.timedelta(seconds=timeout_s))
