"""A rank's coordinates in its replica's mesh ("shard", "tp", "pp") and what they mean for its
gradients: which elements its share of the replica's norm counts, and the tied parameters'
group between the first and last pipeline stage; and the layouts exact mode supports.

Invariant: over a replica's ranks every gradient element counts once in the norm (a replicated
copy only at coordinate 0 of each dimension it is replicated along, a parameter tied across the
pipeline only on the first stage), and a tied parameter's reduced gradient is the sum of its two
stages'. A dimension the mesh does not name is one of size 1, coordinate 0.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from recover.layouts.sharded import is_dtensor, local_tensor

__all__ = ["check_exact", "coord", "counts_in_norm", "owned_sq_sum", "sum_tied", "tied_group"]


def coord(mesh: DeviceMesh | None, dim: str) -> tuple[int, int]:
    """(this rank's coordinate, size) along a named mesh dimension; (0, 1) if absent."""
    if mesh is None or dim not in (mesh.mesh_dim_names or ()):
        return 0, 1
    return mesh.get_local_rank(dim), mesh.size(mesh.mesh_dim_names.index(dim))


def counts_in_norm(p: nn.Parameter, tp: int, pp: int, tied: bool) -> bool:
    """Whether this rank's copy of `p` counts in the replica's gradient norm."""
    if tied and pp != 0:
        return False
    if is_dtensor(p):
        from torch.distributed.tensor import Replicate

        for d, pl in enumerate(p.placements):
            if isinstance(pl, Replicate) and p.device_mesh.get_local_rank(d) != 0:
                return False
        return True
    return tp == 0  # a plain tensor in a TP replica is a replicated copy


def owned_sq_sum(params: Sequence[nn.Parameter], owned: Sequence[bool],
                 device: torch.device) -> torch.Tensor:
    """The sum of squares of the gradient elements this rank counts (`counts_in_norm`), in
    float64 on `device`: summed over the replica's ranks, the squared norm."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p, o in zip(params, owned, strict=True):
        if o and p.grad is not None:
            sq += local_tensor(p.grad).double().pow(2).sum()
    return sq


def tied_group(mesh: DeviceMesh, rank: int) -> dist.ProcessGroup | None:
    """One group per pipeline line: {first stage, last stage} at the same other coordinates;
    built on every rank in the same order (new_group is collective). Returns `rank`'s."""
    names = list(mesh.mesh_dim_names)
    grid = mesh.mesh.movedim(names.index("pp"), 0)
    grid = grid.reshape(grid.shape[0], -1)
    mine = None
    for c in range(grid.shape[1]):
        ranks = sorted({int(grid[0, c]), int(grid[-1, c])})
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def sum_tied(tied: Sequence[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum the tied parameters' gradients across their two stages (`group`: `tied_group`'s)."""
    if not tied or group is None:
        return
    for p in tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(local_tensor(p.grad), group=group)


def check_exact(mesh: DeviceMesh | None) -> None:
    """Exact mode needs each microbatch's gradient to be a pure function of its id wherever it
    runs: deterministic kernels, one intra-op thread on CPU (a reduction split over threads
    sums in another order), and the same layout on every replica (plain or hsdp)."""
    names = set(mesh.mesh_dim_names or ()) if mesh is not None else set()
    if names - {"shard"}:
        raise ValueError(f"exact mode supports plain and hsdp replicas, not a mesh with "
                         f"{sorted(names)}")
    if torch.get_num_threads() != 1:
        raise ValueError(f"exact mode needs torch.set_num_threads(1) (now "
                         f"{torch.get_num_threads()}): CPU reductions split over threads sum "
                         "in a thread-count-dependent order")
    # cuBLAS needs a fixed workspace to be deterministic (its documented requirement).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # Not its filling of every new tensor with NaN, a debugging aid for code that reads memory
    # it never wrote (no torch kernel does), at a cost (docs/MEASUREMENTS.md, "Exact mode's cost").
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
