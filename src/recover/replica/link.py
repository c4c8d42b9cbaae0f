"""A multi-rank replica's agreement inside itself, for its speaker (recovery/speaker.py).

Invariant: `agree` and `share` are collectives of the replica's own process group (its default
group: one per torchrun), called by every rank at the same points of the step protocol (the
order: recovery/speaker.py); each
returns the same value on every rank, or raises on every rank within its bound. While one
waits, the rank's main thread reports progress (a protocol wait, like a store wait), so a
sibling blocked on its speaker is not taken for a deadlocked one; an error of the group (a
sibling died) goes through the replica's `guard` (report the replica lost, wait to be fenced).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from recover.control import Member, keys
from recover.deadline import Deadline
from recover.recovery import SPEAKER_FAILED, SPEAKER_LOST, RecoveryError, from_speaker

# What a speaker shares, by code: a decision, or that it raised (then so do its siblings).
_CODES = (keys.REDO, keys.COMMIT, keys.COMMIT_PLAN, SPEAKER_FAILED, SPEAKER_LOST)


class IntraReplicaLink:
    """`recovery.ReplicaLink` over the default process group of a replica's ranks.

    `device`: where the group's tensors live (the replica's gradients' device: CPU for gloo, the
    rank's GPU for NCCL); `bound_s`: the longest one call may wait (what a speaker's decision
    may take: `Replica` gives 2 x 3 reduce timeouts, its wait then the evidence's); `guard`: the
    replica's guard of an intra-replica collective."""

    def __init__(self, member: Member, device: torch.device, bound_s: float,
                 guard: Callable[[], AbstractContextManager[Any]]) -> None:
        self.member, self.device, self.bound_s, self.guard = member, device, bound_s, guard

    def agree(self, g: int, ok: bool) -> bool:
        t = torch.tensor([int(ok), g, -g], dtype=torch.int64, device=self.device)
        self._run(lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True))
        every_ok, low, minus_high = t.tolist()
        return every_ok == 1 and low == -minus_high == g

    def share(self, value: bytes | None) -> bytes:
        # One broadcast for a decision or a speaker's failure (a code); a chain entry (any
        # other bytes) follows its length in a second one.
        code = -1 if value is None else _CODES.index(value) if value in _CODES else len(_CODES)
        head = torch.tensor([code, len(value or b"")], dtype=torch.int64, device=self.device)
        self._run(lambda: dist.broadcast(head, src=0, async_op=True))
        code, size = head.tolist()
        if code < len(_CODES):
            return from_speaker(_CODES[code])
        if size == 0:
            return b""
        body = (torch.frombuffer(bytearray(value), dtype=torch.uint8) if value is not None
                else torch.empty(size, dtype=torch.uint8)).to(self.device)
        self._run(lambda: dist.broadcast(body, src=0, async_op=True))
        return bytes(body.cpu().tolist())

    def _run(self, issue: Callable[[], Any]) -> None:
        """Issue one collective and wait for it, reporting progress, within `bound_s`."""
        with self.guard():
            work = issue()
            done = threading.Event()
            work.get_future().add_done_callback(lambda _f: done.set())
            deadline = Deadline(self.bound_s)
            while not done.wait(0.05):
                self.member.watch.progress()  # a protocol wait, not a stuck thread
                if deadline.passed():
                    raise RecoveryError(f"no agreement inside the replica within "
                                        f"{self.bound_s:.0f}s")
            work.wait()  # raises what the collective raised (a sibling died)

