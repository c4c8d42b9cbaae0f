"""A digest of a replica's parameters after a step: the proof a metrics line carries.

Invariant: the digest is a pure function of the replica's parameter values, its layout and the
fixed projection seeds: two replicas (of one run or of two runs of one layout) holding the same
bits give the same digest, bit for bit, on any machine that runs the same kernels. It is:

- `proj`: `PROJECTIONS` partial dot products in float64, summed over the parameters (by name)
  and the replica's ranks: with v a standard normal vector drawn from a generator seeded by (the
  parameter's name, the rank's position), proj_k sums v_i p_i over the coordinates i = k mod K.
  v is drawn again at each call (no memory kept) and once per parameter (one draw, not K). For
  two parameter states p, q, E[sum_k (proj_k(p) - proj_k(q))^2] = ||p - q||^2: `rel_distance`
  turns two digests into an estimate of the parameters' relative L2 distance, with no file.
- `sq`: the sum of squares of every parameter (float64), the scale of that distance.
- `sha` (exact mode only): the SHA-256 of every parameter's bytes, 13 hex digits of each rank's
  summed over the ranks (an exact integer sum): any one bit of any parameter changes it.

The digest of a multi-rank replica is the sum of its ranks' parts (one intra-replica all-reduce,
an `Replica.guard()` collective): it is layout-specific, so compare runs of one layout.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from recover.layouts.sharded import local_tensor
from recover.workload import Stream, id_seed

PROJECTIONS = 8  # 8 partial sums: the distance estimate's spread is about 1/sqrt(2 x 8) of it
_STREAM = Stream.DIGEST  # id_seed's stream for the projection vectors (the registry: `Stream`)
_SHA_HEX = 13  # 52 bits of each rank's hash: a sum over up to 2^11 ranks stays below 2^63


@dataclass(frozen=True)
class Digest:
    proj: tuple[float, ...]
    sq: float
    sha: str | None = None

    def to_json(self) -> dict:
        out: dict = {"proj": list(self.proj), "sq": self.sq}
        if self.sha is not None:
            out["sha"] = self.sha
        return out

    @classmethod
    def from_json(cls, d: object) -> Digest | None:
        """The digest a metrics line carries; None for anything that is not one."""
        if not isinstance(d, dict):
            return None
        proj, sq, sha = d.get("proj"), d.get("sq"), d.get("sha")
        if not (isinstance(proj, list) and proj and all(isinstance(x, float) for x in proj)
                and isinstance(sq, float) and (sha is None or isinstance(sha, str))):
            return None
        return cls(tuple(proj), sq, sha)


def _name_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")


@torch.no_grad()
def local_digest(module: torch.nn.Module, position: int = 0, exact: bool = False
                 ) -> tuple[torch.Tensor, int]:
    """This rank's part: float64 [proj_0..proj_{K-1}, sq], and its hash as an int (0 without
    `exact`). The parameters are read in name order, each rank its local shard."""
    parts: list[torch.Tensor] = []  # on the parameters' device: one copy to the host at the end
    sha = hashlib.sha256() if exact else None
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        t = local_tensor(p.detach())
        flat = t.reshape(-1).to(torch.float64)
        g = torch.Generator(device=t.device)
        g.manual_seed(id_seed(_name_seed(name), position, stream=_STREAM))
        v = torch.randn(flat.numel(), generator=g, dtype=torch.float32, device=t.device)
        prod = flat * v.to(torch.float64)
        n, k = prod.numel(), PROJECTIONS
        part = prod[: n - n % k].view(-1, k).sum(0)  # column c: the coordinates i = c mod K
        if n % k:
            part[: n % k] += prod[n - n % k:]
        parts.append(torch.cat([part, torch.dot(flat, flat).view(1)]).cpu())
        if sha is not None:
            sha.update(name.encode() + b"\0")
            sha.update(t.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    acc = torch.zeros(PROJECTIONS + 1, dtype=torch.float64)
    for row_t in parts:  # in name order: the same additions on every replica
        acc += row_t
    return acc, (int(sha.hexdigest()[:_SHA_HEX], 16) if sha is not None else 0)


def replica_digest(module: torch.nn.Module, position: int = 0, nranks: int = 1,
                   exact: bool = False) -> Digest:
    """The replica's digest: its ranks' parts summed (an intra-replica all-reduce on the default
    process group, the replica's own, when it has more than one rank: call it on every rank)."""
    acc, sha = local_digest(module, position, exact)
    if nranks > 1:
        device = _group_device()
        floats, ints = acc.to(device), torch.tensor([sha], dtype=torch.int64, device=device)
        dist.all_reduce(floats)
        dist.all_reduce(ints)
        acc, sha = floats.cpu(), int(ints.item())
    vals = acc.tolist()
    return Digest(tuple(vals[:PROJECTIONS]), vals[PROJECTIONS],
                  f"{sha:016x}" if exact else None)


def _group_device() -> torch.device:
    """Where the default group's collectives take tensors: CUDA for NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rel_distance(a: Digest, b: Digest) -> float:
    """An estimate of ||p_a - p_b|| / ||p_b|| from two digests of one layout (0 when equal)."""
    if a.proj == b.proj and a.sq == b.sq:
        return 0.0
    ss = sum((x - y) ** 2 for x, y in zip(a.proj, b.proj, strict=True))
    return math.sqrt(ss) / math.sqrt(max(b.sq, 1e-300))
