"""A replica's own process group and device mesh.

Invariant: the ranks of one replica, and only they, form a default process group, so FSDP2, DTensor
and pipelining (which use the default group) never reach across replicas; everything that crosses
replicas goes through recover's fault-tolerant communicators. `recover train` builds that group on
the coordinator's store under `group_prefix` (`replica{r}.{incarnation}.{key}`, the key derived
from the run token); under `torchrun` (one per replica) the user's usual `init_process_group()`
does the same job. The mesh's row-major rank order is the rank's position: with ("pp", "tp"),
rank = pp * tp_size + tp.

Nothing of a run's is touched before its token is checked: `init_replica_group` first compares
the coordinator's proof of its token with its own (a worker of another run stops with one line),
then claims its (replica, incarnation, rank) once (a duplicate stops with one line), and only then
rendezvous, under a prefix that a process without the token cannot name.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket

import torch.distributed as dist
from torch.distributed import PrefixStore
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recover.control import CoordinatorLost, connect_store, keys
from recover.control.admission import proof
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


def group_prefix(replica: int, incarnation: str, token: str | None) -> str:
    """Where replica `replica`'s own group meets in the coordinator's store: per incarnation (a
    restarted replica's earlier keys are stale), and keyed by the run token, so a worker of
    another run cannot name, let alone reset, a real replica's rendezvous."""
    return f"replica{replica}.{incarnation}.{proof(token, 'replica-group')[:32]}"


def check_run(store: dist.Store, token: str | None, timeout_s: float) -> None:
    """CoordinatorLost (one line) unless the coordinator's run token is ours (a coordinator
    without one admits anyone, as its hello check does)."""
    store.wait([keys.RUN_PROOF], datetime.timedelta(seconds=timeout_s))
    theirs = store.get(keys.RUN_PROOF).decode()
    if theirs != "-" and theirs != proof(token, keys.RUN_PURPOSE):
        raise CoordinatorLost("the coordinator refused this process: wrong run token (another "
                              "run's coordinator, or RECOVER_RUN_TOKEN is not this run's)")


def claim_rank(store: dist.Store, prefix: str, rank: int) -> None:
    """Take (replica, incarnation, rank) once; CoordinatorLost (one line) if another process
    holds it: a duplicate worker must not join the real one's group."""
    me = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(8)}"
    held = store.compare_set(f"{prefix}/rank{rank}", "", me).decode(errors="replace")
    if held != me:
        who = " ".join(held.split()[:3])
        raise CoordinatorLost(f"the coordinator refused this process: rank {rank} of this "
                              f"replica ({prefix.split('.')[0]}) is already running ({who})")


def init_replica_group(host: str, port: int, replica: int, rank: int, nranks: int,
                       timeout_s: float = 60.0, incarnation: str | None = None,
                       token: str | None = None) -> None:
    """The replica's default process group, on the coordinator's store (`group_prefix`), after
    the run's token and this rank's claim are checked (see the module docstring).

    `incarnation` (default: the launcher's, `LaunchEnv.incarnation`): a restarted replica builds
    its group afresh under a new prefix, since its earlier incarnation's keys are stale. `token`:
    the run's secret (None: the run has none).
    """
    inc = LaunchEnv.from_env().incarnation if incarnation is None else incarnation
    store = connect_store(host, port, timeout_s)
    check_run(store, token, timeout_s)
    prefix = group_prefix(replica, inc, token)
    claim_rank(store, prefix, rank)
    dist.init_process_group("gloo", store=PrefixStore(prefix + "/pg", store), rank=rank,
                            world_size=nranks, timeout=datetime.timedelta(seconds=timeout_s))
