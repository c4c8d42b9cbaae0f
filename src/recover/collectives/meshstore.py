"""A generation's communicator built on the store (`new_group`), and gloo's full-mesh rendezvous
in O(1) store requests and O(R) bytes per member.

gloo connects every pair of a group's members. To do so each member publishes its address under
`"{device}/{rank}"` and then reads every member's, one blocking `wait` and one `get` each: 2R
requests per member of an R-member group, 2R^2 on the store server that hosts the group's
rendezvous (a shard: docs/DESIGN.md, "Scaling the control plane"). `MeshStore` is the store gloo
is given: the first read of such a key waits for all R members' keys of that device in one
request and reads them in one `multi_get`; the other R - 1 reads are answered from those bytes.
A member then asks the server 3 things (the barrier's count and wait aside): a set of its own
address, a wait and a multi_get, whatever R (docs/MEASUREMENTS.md, "The control plane at scale").
With pairs named by rank (`GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER`, below) an address carries no
identifier per peer, so those reads are O(R) bytes, not O(R^2).

Invariant: gloo reads through a `MeshStore` exactly the bytes the inner store holds for every key,
with the same blocking and timeout as its own reads: the keys answered from memory are written
once per group, by their member, before anyone reads them (a group's prefix is its generation's
and position's), and were read only after the inner store held them all. Every other call is
forwarded unchanged.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

# gloo identifies a pair by the peer's rank, not by a sequence number each member publishes for
# every other: a member's address in the rendezvous is then O(1) bytes, not O(R), so the store
# sends each member O(R) bytes, not O(R^2) (docs/MEASUREMENTS.md, "The control plane at scale").
# Read by gloo at every build, by both ends of a pair: every process of a run imports this (with
# collectives/comm.py) before it builds a cross-replica group. Set at import (not around each
# build: a setenv while other threads read the environment is not safe); a user's value is kept.
os.environ.setdefault("GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", "1")


def new_group(backend: str, store: Any, rank: int, size: int, timeout_s: float,
              ifname: str | None = None, addr: str | None = None) -> object:
    """A communicator built directly on the store: no default group, one per generation.

    gloo binds the named interface(s) (comma-separated), else `addr`, else gloo's default (the
    hostname's address).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        if not ifname and not addr:
            return ProcessGroupGloo(store, rank, size, timeout)
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = ([ProcessGroupGloo.create_device(interface=i) for i in ifname.split(",")]
                         if ifname else [ProcessGroupGloo.create_device(hostname=addr)])
        return ProcessGroupGloo(store, rank, size, opts)
    # NCCL (untested on the CPU machines this project runs CI on): its watchdog must not kill
    # the process when a peer dies; recover detects, abandons and rebuilds instead.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, size, opts)


_RANK_KEY = re.compile(r"(\d+)/(\d+)")  # gloo's per-device address key: "{device}/{rank}"


class MeshStore(dist.Store):
    """The store a `size`-member gloo group meets on: reads of its members' addresses batched.

    gloo holds it through a C++ pointer: its owner keeps it referenced as long as the group (a
    collected Python store leaves gloo a pointer without methods)."""

    def __init__(self, inner: Any, size: int) -> None:
        super().__init__()
        self._inner, self._size = inner, size
        self._read: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.batches = 0  # devices whose addresses were read in one request (tests, benches)

    def _batch(self, key: str, timeout: datetime.timedelta | None) -> bool:
        """Whether `key` is a member's address, read now (with every member's of its device)
        if it was not yet."""
        m = _RANK_KEY.fullmatch(key)
        if m is None or int(m.group(2)) >= self._size:
            return False
        with self._lock:
            if key not in self._read:
                names = [f"{m.group(1)}/{r}" for r in range(self._size)]
                self._wait_inner(names, timeout)
                self._read.update(zip(names, self._inner.multi_get(names), strict=True))
                self.batches += 1
        return True

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        rest = [k for k in keys if not self._batch(k, timeout)]
        if rest:
            self._wait_inner(rest, timeout)

    def _wait_inner(self, keys: list[str], timeout: datetime.timedelta | None) -> None:
        if timeout is None:  # the inner store's own timeout
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def get(self, key: str) -> bytes:
        if self._batch(key, None):
            return self._read[key]
        return self._inner.get(key)

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, value)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)
