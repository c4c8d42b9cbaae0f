"""One rank's protocol stack, wired once: its `Member`, `FaultTolerantComm` and `StepEngine`.

Invariant: this module is the only place that builds a rank's stack. Every setting reaches the
three objects from one `ReplicaConfig` (its `FaultTolerance` and `Numerics`) and every injected
fault from one `Hooks`, so `recover.Replica`, the test harness and the benchmarks run the same
wiring. A member that fails to join, or whose `on_joined` step fails, is shut down before the
error propagates: its heartbeat and liveness threads never outlive a failed join.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from recover.collectives import FaultTolerantComm, connect
from recover.control import FenceHandlers, Identity, Member
from recover.recovery import GradAccess, ReplicaLink, StepEngine, StepStrategy
from recover.settings import Hooks, ReplicaConfig


@dataclass
class RankStack:
    """A joined rank: its membership, its cross-replica communicator and its step engine."""

    member: Member
    comm: FaultTolerantComm
    engine: StepEngine


def new_member(config: ReplicaConfig, rank: int = 0, nranks: int = 1, *, applied: int = -1,
               last_generation: int = -1,
               on_fenced: Callable[[str], None] | None = None) -> Member:
    """This rank's `Member`, not yet joined (`connect_rank` joins it).

    `applied`, `last_generation`: where a process that holds run state stands, told to a
    restarted coordinator (-1: none). `on_fenced`: replaces the process exit on fencing (an
    in-process harness, whose ranks are threads).
    """
    cfg = config.resolved()
    host, port = cfg.host_port()
    assert cfg.replica is not None  # resolved() guarantees it
    assert cfg.launch is not None  # resolved() sets it
    identity = Identity(token=cfg.token, fingerprint=cfg.fingerprint,
                        join_at=cfg.launch.join_at, applied=applied,
                        last_generation=last_generation)
    return Member(host, port, cfg.replica, rank, nranks, ft=cfg.ft, identity=identity,
                  handlers=FenceHandlers(fenced=on_fenced))


def connect_rank(member: Member, grads: GradAccess | torch.Tensor, microbatches: int,
                 config: ReplicaConfig, *, hooks: Hooks | None = None,
                 strategy: StepStrategy | None = None,
                 on_joined: Callable[[Member], None] | None = None,
                 comm_class: type[FaultTolerantComm] = FaultTolerantComm,
                 shared_speeds: bool | None = None,
                 link: ReplicaLink | None = None) -> RankStack:
    """Join `member`, run `on_joined(member)` (a joiner receives its state there, before any of
    its traffic), then build the rank's communicator (at position = its rank) and step engine.

    `grads`: the rank's local gradient (a layout's `GradAccess`, or one flat tensor).
    `comm_class`: a `FaultTolerantComm` subclass (harnesses that instrument the reduce).
    `shared_speeds`: every rank of the replica holds the same speeds (default: one rank per
    replica), so the engine may imply a speed-aware plan instead of reading it.
    `link`: a multi-rank replica's own agreement (its rank 0 then speaks for it to the store).
    """
    hooks = hooks or Hooks()
    ft, num = config.ft, config.numerics
    # Layer 1's wiring: join (shut down on failure), on_joined, the communicator.
    comm = connect(member, ft, num, device=grads.device, hooks=hooks, on_joined=on_joined,
                   comm_class=comm_class)
    engine = StepEngine(member, comm, grads, microbatches, ft=ft,
                        numerics=num, hooks=hooks, strategy=strategy, shared_speeds=shared_speeds,
                        link=link)
    return RankStack(member, comm, engine)
