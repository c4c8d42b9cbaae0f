"""HSDP: each replica is an FSDP2 shard group; recover replaces the cross-replica all-reduce.

Invariant: the k shard ranks of a replica split every microbatch id's B sequences into k equal,
contiguous row blocks (rank s takes rows [s*B/k, (s+1)*B/k)). Each rank backpropagates the mean
loss over its rows / N; FSDP2's reduce-scatter averages over the shard group, so the replica's
sharded gradient is grad(mean loss over the B sequences) / N per id, the same as a plain replica's.
Shard s of every replica holds the same slice of every parameter, so the cross-replica reduction of
position s sums like with like; that is native HSDP's all-reduce over the "replicate" dimension,
done after backward from a kept copy (it matches native HSDP: docs/MEASUREMENTS.md, "Parallel
layouts on CPU").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_mesh(shards: int) -> DeviceMesh:
    """The replica's 1-D mesh ("shard",) over its default process group."""
    return init_device_mesh("cpu", (shards,), mesh_dim_names=("shard",))


def shard_model(model: nn.Module, mesh: DeviceMesh, units: Iterable[nn.Module] = ()) -> nn.Module:
    """FSDP2 over the shard group: one parameter group per unit (e.g. each transformer block),
    plus the root for the rest."""
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_rows(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """This shard rank's contiguous block of rows of a microbatch tensor `[B, ...]`."""
    if mesh is None or "shard" not in (mesh.mesh_dim_names or ()):
        return t
    k = mesh.size(mesh.mesh_dim_names.index("shard"))
    s = mesh.get_local_rank("shard")
    if t.size(0) % k:
        raise ValueError(f"microbatch size {t.size(0)} is not divisible by {k} shards")
    b = t.size(0) // k
    return t[s * b: (s + 1) * b]
