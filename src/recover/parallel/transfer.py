"""Live state transfer: a donor rank streams its training state to the same rank of a joiner.

The wire carries tensors and JSON only, never a pickle: a length-prefixed JSON header (the
state's non-tensor leaves, and each tensor's path, dtype and shape), the tensors' raw bytes in
chunks, and a sha256 of those bytes that the joiner verifies before it uses anything. The
joiner copies the values *in place* into its own module and optimizer (same layout, so the same
local shard shapes; DTensor shards included), so nothing about sharding travels.

Invariant: `receive` returns only a state whose every byte matched the donor's digest, with the
same tensor paths, dtypes and shapes as the joiner's own; anything else raises `TransferError`
and leaves the joiner to try another donor.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from recover.parallel.grads import local_tensor

CHUNK = 4 << 20
MAGIC = b"RCVR-STATE-1"
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                               torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                               torch.bool)}


class TransferError(RuntimeError):
    """The state could not be received intact (peer gone, mismatch, corrupt bytes)."""


# -- what is transferred --------------------------------------------------------------------
class TrainingState:
    """The live tensors of one rank's training state, by path, and its JSON leaves.

    Paths are stable between two ranks of the same layout: module state_dict keys, optimizer
    state by parameter index, then `extra` (objects with `state_dict()`/`load_state_dict()`).
    `tensors` are the live ones (local shards of DTensors): writing into them updates the module
    and the optimizer; `finish()` applies the JSON leaves and reloads the extra objects.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 extra: Mapping[str, Any]) -> None:
        self.optimizer, self.extra = optimizer, dict(extra)
        tensors: list[tuple[str, torch.Tensor]] = []
        for k, v in module.state_dict(keep_vars=True).items():
            tensors.append((f"model/{k}", local_tensor(v.data if isinstance(v, nn.Parameter)
                                                       else v)))
        meta: dict[str, Any] = {}
        if optimizer is not None:
            index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                                    for p in g["params"])}
            for p, st in optimizer.state.items():
                for name, v in sorted(st.items()):
                    path = f"optim/{index[id(p)]}/{name}"
                    if isinstance(v, torch.Tensor):
                        tensors.append((path, local_tensor(v)))
                    else:
                        meta[path] = v
            meta["optim/param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                          for g in optimizer.param_groups]
        self.extra_sd = {name: obj.state_dict() for name, obj in self.extra.items()}
        for name, sd in self.extra_sd.items():
            for path, leaf in _leaves(f"extra/{name}", sd):
                if isinstance(leaf, torch.Tensor):
                    tensors.append((path, leaf))
                else:
                    meta[path] = leaf
        tensors.sort(key=lambda pt: pt[0])
        self.tensors, self.meta = tensors, meta

    def finish(self, meta: dict) -> None:
        """Apply the donor's JSON leaves (optimizer hyperparameters and scalar state), and hand
        the extra objects their received state dicts."""
        opt = self.optimizer
        if opt is not None:
            params = [p for g in opt.param_groups for p in g["params"]]
            for g, theirs in zip(opt.param_groups, meta.get("optim/param_groups", []),
                                 strict=False):
                g.update(theirs)
            for path, v in meta.items():
                if path.startswith("optim/") and path != "optim/param_groups":
                    _, i, name = path.split("/", 2)
                    opt.state[params[int(i)]][name] = v
        for name, obj in self.extra.items():
            sd = self.extra_sd[name]
            _fill(sd, f"extra/{name}", meta)
            obj.load_state_dict(sd)


def _leaves(prefix: str, obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            yield from _leaves(f"{prefix}/{k}", obj[k])
    else:
        yield prefix, obj


def materialize_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create a never-stepped optimizer's lazy state (a step at lr 0 with zero gradients), so a
    joiner's state has the donor's tensor paths; every value is then overwritten."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    saved = []
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            saved.append((p, p.grad))
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in saved:
        p.grad = grad


# -- the wire -------------------------------------------------------------------------------
def send(sock: socket.socket, tensors: list[tuple[str, torch.Tensor]], meta: dict) -> int:
    """Stream the state; return the bytes sent. The peer answers b'ok' once it verified."""
    header = {"meta": meta, "tensors": [(p, str(t.dtype), list(t.shape)) for p, t in tensors]}
    raw = json.dumps(header).encode()
    sock.sendall(MAGIC + struct.pack("!Q", len(raw)) + raw)
    digest = hashlib.sha256()
    total = 0
    for _, t in tensors:
        data = _bytes(t)
        for i in range(0, len(data), CHUNK):
            part = data[i: i + CHUNK]
            digest.update(part)
            sock.sendall(part)
        total += len(data)
    sock.sendall(digest.digest())
    if _recv_exact(sock, 2) != b"ok":
        raise TransferError("the joiner refused the state")
    return total


def receive(sock: socket.socket, tensors: list[tuple[str, torch.Tensor]], meta: dict
            ) -> tuple[dict, int]:
    """Receive into the joiner's own live tensors (same paths, dtypes, shapes), verify the
    digest, and return (the donor's JSON leaves, bytes received). On any mismatch nothing is
    copied in: values land in staging buffers first."""
    if _recv_exact(sock, len(MAGIC)) != MAGIC:
        raise TransferError("not a recover state stream")
    (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
    header = json.loads(_recv_exact(sock, n))
    theirs = [(p, d, tuple(s)) for p, d, s in header["tensors"]]
    mine = [(p, str(t.dtype), tuple(t.shape)) for p, t in tensors]
    if theirs != mine:
        diff = next((a, b) for a, b in zip(theirs + [None], mine + [None], strict=False)
                    if a != b)
        raise TransferError(f"the donor's state does not match this rank's layout: {diff}")
    digest = hashlib.sha256()
    staged, total = [], 0
    for _, t in tensors:
        buf = torch.empty(t.shape, dtype=t.dtype)
        view = memoryview(_bytes(buf)).cast("B")
        got = 0
        while got < len(view):
            k = sock.recv_into(view[got:], min(CHUNK, len(view) - got))
            if k == 0:
                raise TransferError("the donor went away during the transfer")
            got += k
        digest.update(view)
        staged.append(buf)
        total += len(view)
    if _recv_exact(sock, 32) != digest.digest():
        sock.sendall(b"no")
        raise TransferError("state checksum mismatch")
    with torch.no_grad():
        for (_, t), buf in zip(tensors, staged, strict=True):
            t.copy_(buf)
    sock.sendall(b"ok")
    return header["meta"], total


def _bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes (a CPU copy for device tensors), without pickling."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise TransferError("the peer went away during the transfer")
        out += part
    return bytes(out)


def _fill(sd: Any, prefix: str, meta: dict) -> None:
    if isinstance(sd, dict):
        for k in sd:
            path = f"{prefix}/{k}"
            if isinstance(sd[k], dict):
                _fill(sd[k], path, meta)
            elif path in meta:
                sd[k] = meta[path]


def connect(addr: str, timeout_s: float) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            s = socket.create_connection((host, int(port)), timeout=timeout_s)
            return s
        except OSError as e:
            if time.monotonic() > deadline:
                raise TransferError(f"cannot reach the donor at {addr}: {e}") from None
            time.sleep(0.05)
