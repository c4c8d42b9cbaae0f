"""A small payload's all-reduce as a binary tree over a gloo group's point-to-point operations.

Invariant: an operation `TreeDriver.submit(tensor)` returns completes its future only after
`tensor` holds, on every member alike, the sum over all members of the group (reduced up a
binary tree to rank 0, then sent down the same tree: every member ends with the root's bytes),
or sets an exception on it; never a partial sum reported as done. Every wait is bounded by the
group's timeout. The operations of one group run one after another on the group's own thread, in
the order submitted: members that submit the same operations in the same order (the step
protocol's rule for a reduction) meet in each, matched by a tag counted per group. The buffers an
operation writes into (the tensor, the children's receive buffers) and its gloo works stay
referenced by `works` until the caller lets go of the group (`reaper.retire`), so a receive that
gloo still holds after a failed wait never writes into freed memory.

Why not gloo's ring for these (docs/MEASUREMENTS.md, "The tree for small payloads"): on CPU,
gloo's `allreduce` takes 2(R - 1) steps, each a hand-off between gloo's threads, so its CPU and
latency per member grow with R however small the payload, while the tree's stay flat (at most 3
peers per member: O(1) in R; `bench/tree.py`). Past `TREE_MAX_BYTES` the ring's 2 bytes moved
per byte reduced beat the tree's 6 on its inner nodes, so larger payloads keep gloo's ring.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TREE_MAX_BYTES", "TreeDriver", "fits"]

log = logging.getLogger(__name__)

# Payloads up to this size go up and down the tree; larger ones through gloo's ring, whose fewer
# bytes moved per byte reduced cost the busiest member less CPU past about this size at small R
# (docs/MEASUREMENTS.md, "The tree for small payloads"); the first bucket issued
# (`recovery.buckets.FIRST_BUCKET_BYTES`, 1 MiB) fits.
TREE_MAX_BYTES = 1 << 20
_TAGS = 1 << 30  # tags wrap here (gloo takes a non-negative int)
_IDLE_S = 1.0  # the thread's wait for work, between checks that it is still wanted


def fits(tensor: torch.Tensor) -> bool:
    """Whether `tensor` takes the tree: on the CPU, dense, contiguous and small."""
    return (tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.layout ==
            torch.strided and tensor.numel() * tensor.element_size() <= TREE_MAX_BYTES)


@dataclass
class _Op:
    tensor: torch.Tensor
    tag: int
    fut: torch.futures.Future = field(default_factory=torch.futures.Future)
    works: list[Any] = field(default_factory=list)  # gloo works and buffers, kept (see above)


class TreeDriver:
    """The tree operations of one gloo group (`pg`, this member's `rank` of `size`); its thread
    starts at the first `submit` and ends at `close` (or with the process: a daemon)."""

    def __init__(self, pg: Any, rank: int, size: int, timeout_s: float, name: str) -> None:
        self.pg, self.rank, self.size = pg, rank, size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.name = name
        self.parent = (rank - 1) // 2 if rank else None
        self.children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < size]
        self._ops: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failed: str | None = None  # why an operation failed (no traceback: `_run`)
        self._lock = threading.Lock()  # `submit` and `close`: a submission after a close fails
        self._next_tag = 0

    def submit(self, tensor: torch.Tensor) -> tuple[torch.futures.Future, list[Any]]:
        """Start summing `tensor` in place over the group; never blocks on the peers. Returns
        the operation's future and the list that keeps its buffers and works (grows while it
        runs; hand it to the reaper with the group)."""
        with self._lock:
            op = _Op(tensor, self._next_tag)
            self._next_tag = (self._next_tag + 2) % _TAGS  # one tag up the tree, one down
            op.works.append(tensor)
            if self._closed:
                op.fut.set_exception(self._let_go())
                return op.fut, op.works
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._ops.put(op)
        return op.fut, op.works

    def close(self, wait_s: float = 0.0) -> None:
        """No more operations: the thread ends after the one it runs (whose waits are bounded),
        dropping its references to the group and to the operations' works; operations still
        queued fail. `wait_s`: how long to wait for that end (a test's teardown; the
        communicator never waits, `reaper.retire` does it off its thread)."""
        with self._lock:
            self._closed = True
            thread = self._thread
            if thread is None:
                self.pg = None  # never used
                return
            self._ops.put(None)
        if wait_s > 0:
            thread.join(wait_s)

    def _loop(self) -> None:
        # `close` queues the None after every operation submitted before it (a later `submit`
        # fails at once): those ahead of it fail in `_run`, unattempted.
        try:
            while True:
                try:
                    op = self._ops.get(timeout=_IDLE_S)
                except queue.Empty:
                    continue
                if op is None:
                    return
                self._run(op)
        finally:
            self.pg = None

    def _let_go(self) -> RuntimeError:
        return RuntimeError(f"{self.name}: the group was let go")

    def _run(self, op: _Op) -> None:
        # Never attempted on a broken or let-go group: the peers' matching operations fail too,
        # and a later one would meet a peer's earlier one.
        if self._closed:
            op.fut.set_exception(self._let_go())
            return
        if self._failed is not None:
            op.fut.set_exception(RuntimeError(f"{self.name}: an earlier operation failed: "
                                              f"{self._failed}"))
            return
        try:
            self._tree(op)
        except Exception as e:  # a peer died, a socket was severed, or a wait timed out
            log.debug("%s: tree operation %d failed: %s", self.name, op.tag // 2, e)
            # A new exception, without the traceback: the raised one's frames hold `op`, so
            # its works, which the future (retired with them) would keep alive in a cycle the
            # reaper only breaks after UNOWNED_KEEP_S, polling every 2 ms for the first second.
            self._failed = (str(e).splitlines() or [type(e).__name__])[0][:200]
            op.fut.set_exception(RuntimeError(f"{self.name}: {self._failed}"))
            return
        op.fut.set_result(None)

    def _tree(self, op: _Op) -> None:
        t, up, down = op.tensor, op.tag, op.tag + 1
        bufs = [torch.empty_like(t) for _ in self.children]
        op.works.extend(bufs)
        recvs = [self.pg.recv([b], c, up) for b, c in zip(bufs, self.children, strict=True)]
        op.works.extend(recvs)
        for w, b in zip(recvs, bufs, strict=True):  # children in rank order: one sum order
            w.wait(self.timeout)
            t.add_(b)
        if self.parent is not None:
            self._wait(self.pg.send([t], self.parent, up), op)
            self._wait(self.pg.recv([t], self.parent, down), op)
        sends = [self.pg.send([t], c, down) for c in self.children]
        op.works.extend(sends)
        for w in sends:
            w.wait(self.timeout)

    def _wait(self, work: Any, op: _Op) -> None:
        op.works.append(work)
        work.wait(self.timeout)
