"""Live state transfer: a donor rank streams its training state to the same rank of a joiner.

The wire carries tensors and JSON only, never a pickle, as frames of a `channel.Session` (keyed
by the run token: authenticated and encrypted, docs/DESIGN.md, "Checkpoints, rejoin and trust"):
a JSON header (the state's non-tensor leaves, and each tensor's path, dtype and shape), the
tensors' raw bytes in chunks of at most `CHUNK`, and an end frame with the byte count; the joiner
answers one sealed frame, b"ok" or b"no". The joiner copies the values *in place* into its own
module and optimizer (same layout, so the same local shard shapes; DTensor shards included), so
nothing about sharding travels.

Invariant: `receive` returns only a state whose every frame the session authenticated, in order
and complete, with the same tensor paths, dtypes and shapes as the joiner's own; anything else
raises `TransferError` or `channel.ChannelError`. A mismatched layout writes nothing; past the
header each frame is decrypted straight into the joiner's tensors (no staging copy of the
state), so after a failure the joiner's state is partly overwritten and is no run state: the
joiner is not a member (it reported no `ready`), it tries the whole transfer again, and until one
succeeds its replica claims no step (`Replica.holds_state`: a hello with -1, no checkpoint).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from recover.deadline import Deadline
from recover.errors import RecoverError
from recover.layouts.sharded import local_tensor
from recover.replica.channel import Session

CHUNK = 4 << 20
HEADER_MAX = 256 << 20  # the JSON header's frame (tensor paths and shapes, scalar leaves)
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                               torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                               torch.bool)}


class TransferError(RecoverError, RuntimeError):
    """The state could not be received intact (peer gone, mismatch, corrupt bytes)."""


# -- what is transferred --------------------------------------------------------------------
class TrainingState:
    """The live tensors of one rank's training state, by path, and its JSON leaves.

    Paths are stable between two ranks of the same layout: the module's parameters and
    persistent buffers by name, optimizer state by parameter index, then `extra` (objects with
    `state_dict()`/`load_state_dict()`). `tensors` are the live ones (local shards of DTensors):
    writing into them updates the module and the optimizer; `finish()` applies the JSON leaves
    and reloads the extra objects. Not the module's `state_dict()`: a state-dict hook may hand
    out copies (torchtitan's fused q/k/v projection splits `wqkv` into new `wq`/`wk`/`wv`
    tensors), and a copy written into changes nothing.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 extra: Mapping[str, Any]) -> None:
        self.optimizer, self.extra = optimizer, dict(extra)
        tensors: list[tuple[str, torch.Tensor]] = []
        saved = set(module.state_dict(keep_vars=True))  # a buffer not in it is not persistent
        for k, v in module.named_parameters():
            tensors.append((f"model/{k}", local_tensor(v.data)))
        for k, v in module.named_buffers():
            if k in saved:
                tensors.append((f"model/{k}", local_tensor(v)))
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
def send(session: Session, tensors: list[tuple[str, torch.Tensor]], meta: dict) -> int:
    """Stream the state; return the bytes sent. The peer answers b'ok' once it verified."""
    header = {"meta": meta, "tensors": [(p, str(t.dtype), list(t.shape)) for p, t in tensors]}
    session.send(json.dumps(header).encode())
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    session.send_all(_chunks([t for _, t in tensors]))
    session.send(b"end" + struct.pack("!Q", total))
    if session.recv(2) != b"ok":
        raise TransferError("the joiner refused the state")
    return total


def _chunks(tensors: list[torch.Tensor]) -> Iterator[memoryview]:
    for t in tensors:
        data = _bytes(t)  # a device tensor is copied to the host one at a time
        for i in range(0, len(data), CHUNK):
            yield data[i: i + CHUNK]


def receive(session: Session, tensors: list[tuple[str, torch.Tensor]], meta: dict
            ) -> tuple[dict, int]:
    """Receive into the joiner's own live tensors (same paths, dtypes, shapes) and return (the
    donor's JSON leaves, bytes received). A layout mismatch writes nothing; past the header,
    each frame is decrypted straight into its tensor's bytes, so a failure part-way leaves the
    tensors partly overwritten (see the module's invariant: the caller then holds no state)."""
    try:
        header = json.loads(session.recv(HEADER_MAX))
        theirs = [(p, d, tuple(s)) for p, d, s in header["tensors"]]
    except (ValueError, TypeError, KeyError) as e:  # authenticated, yet not a header
        raise TransferError(f"not a recover state header: {e}") from None
    mine = [(p, str(t.dtype), tuple(t.shape)) for p, t in tensors]
    if theirs != mine:
        diff = next((a, b) for a, b in zip(theirs + [None], mine + [None], strict=False)
                    if a != b)
        session.send(b"no")
        raise TransferError(f"the donor's state does not match this rank's layout: {diff}")
    sizes = [min(CHUNK, n - i) for n in (t.numel() * t.element_size() for _, t in tensors)
             for i in range(0, n, CHUNK)]
    views = _views([t for _, t in tensors])
    session.recv_all_into(sizes, views)
    next(views, None)  # the last tensor's copy-in, where it needed a host buffer
    total = sum(sizes)
    if session.recv(16) != b"end" + struct.pack("!Q", total):
        raise TransferError("the stream did not end where the donor said")
    session.send(b"ok")
    return header["meta"], total


def _views(tensors: list[torch.Tensor]) -> Iterator[memoryview]:
    """Where each received frame goes, in order: a contiguous CPU tensor's own bytes, else a
    host buffer of the tensor's size, copied in once its last frame is decrypted (one tensor at
    a time, never the whole state)."""
    for t in tensors:
        direct = t.device.type == "cpu" and t.is_contiguous()
        dest = t if direct else torch.empty(t.shape, dtype=t.dtype)
        view = _bytes(dest)
        for i in range(0, len(view), CHUNK):
            yield view[i: i + CHUNK]
        if not direct:
            with torch.no_grad():  # not across a yield: grad mode is the thread's
                t.copy_(dest)


def _bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, without pickling: its own memory for a contiguous CPU tensor (written
    through by `receive`), else a contiguous CPU copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


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
    deadline = Deadline(timeout_s)
    while True:
        try:
            s = socket.create_connection((host, int(port)), timeout=timeout_s)
            return s
        except OSError as e:
            if deadline.passed():
                raise TransferError(f"cannot reach the donor at {addr}: {e}") from None
            time.sleep(0.05)
