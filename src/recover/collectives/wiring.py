"""The one wiring of layer 1: a `Member` joined to its coordinator, and its communicator.

Invariant: a member that `connect` fails to bring into a generation (its join, or the caller's
`on_joined`, raises) is shut down before the error propagates, so no heartbeat or watchdog thread
of it outlives the failure; a communicator is built only for a joined member, at the member's own
rank position, from the same `FaultTolerance` and `Numerics` the caller built the member from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from recover.collectives.comm import FaultTolerantComm
from recover.control.member import Member
from recover.settings import FaultTolerance, Hooks, Numerics


def connect(member: Member, ft: FaultTolerance | None = None, numerics: Numerics | None = None,
            *, device: torch.device | None = None, hooks: Hooks | None = None,
            on_joined: Callable[[Member], None] | None = None,
            comm_class: type[FaultTolerantComm] = FaultTolerantComm) -> FaultTolerantComm:
    """Join `member` (within its ft.join_timeout_s), run `on_joined(member)` (a joiner receives
    its state there), then return its communicator: `comm_class(member, member.rank, ft,
    numerics, device=device)`, whose cross-replica links fail while `hooks.link_down()` says so
    (fault injection)."""
    try:
        member.join()
        if on_joined is not None:
            on_joined(member)
    except BaseException:
        member.shutdown()  # its threads must not outlive a failed join
        raise
    comm = comm_class(member, member.rank, ft, numerics, device=device)
    if hooks is not None:
        comm.link_down = hooks.link_down
    return comm
