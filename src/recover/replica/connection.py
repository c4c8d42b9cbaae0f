"""A `Replica`'s connection to its coordinator: the join, and a restarted coordinator rejoined.

Invariant: a rank's `Member`, communicator and step engine come from one hello to one coordinator:
made together (`Connection.connect`), and closed and replaced together when this replica adopts a
running one's state or its coordinator dies. Before the first hello the coordinator is reached
within `connect_timeout_s` and this rank's identity checked against the run's (one line each
otherwise). A joiner's state is received before any of its traffic, and while a transfer writes
into this rank's tensors, or after one failed part-way, the rank holds no run state
(`holds_state` False: its hello claims no step). A coordinator that dies mid-step is waited for
up to `coordinator_wait_s` with this replica's state kept, and the step runs again from nothing
with the successor; one that resumed the run at another step says so with `Resumed`.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import DistError

from recover.collectives import FaultTolerantComm
from recover.control import CoordinatorGone, CoordinatorLost, Member, RunOver, keys
from recover.control.member import exit_fenced
from recover.deadline import Deadline, poll_until
from recover.errors import first_line
from recover.recovery import BelowMinReplicas, StepEngine, StepResult
from recover.replica import invariant, rejoin
from recover.replica.invariant import CoordinatorGoneForGood, CoordinatorUnreachable, JoinRefused
from recover.replica.link import IntraReplicaLink
from recover.replica.rank import connect_rank, new_member

if TYPE_CHECKING:
    from recover.replica.handle import Replica

log = logging.getLogger(__name__)

__all__ = ["Connection", "Resumed"]


class Resumed(CoordinatorLost):
    """A restarted coordinator resumed the run at another step than the one this replica was in
    (it was one step behind or ahead when the old one died), and this replica received that
    state: the module and optimizer now hold `step` applied steps. Go on with `rep.step(step)`."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the restarted coordinator resumed the run at step {step}: this "
                         f"replica now holds that state; continue the loop from step {step}")
        self.step = step


class Connection:
    """The coordinator side of one `Replica` (`rep`, whose module, optimizer, state, gradients,
    config and hooks a joiner's transfer and the step engine use): this rank's `member`, `comm`
    and `engine`, and what the last join said (`joined`, `start_step`, `transfer_s`)."""

    member: Member
    comm: FaultTolerantComm
    engine: StepEngine

    def __init__(self, rep: Replica) -> None:
        self.rep = rep
        self.start_step, self.transfer_s, self.joined = 0, 0.0, False
        # False while a state transfer writes into this rank's tensors and after one failed
        # part-way: the state is then no run state (a hello claims no step, nothing is saved)
        # until a transfer completes (recover.replica.transfer).
        self.holds_state = True
        self.troubled = False  # a reduce failed here once: end without teardown (`Replica`)

    def check_join(self, identity: dict[str, Any]) -> bool:
        """Before the hello: reach the coordinator within `connect_timeout_s` (else one line
        naming its address), then compare this rank's identity and initial state with the
        run's (`invariant.check_join`). True: this replica takes a running one's state
        (`init="adopt"`, agreed by its ranks)."""
        rep, cfg = self.rep, self.rep.config
        host, port = cfg.host_port()
        if not poll_until(lambda: _accepts(host, port), cfg.connect_timeout_s, 0.1):
            raise CoordinatorUnreachable(
                f"cannot reach the recover coordinator at {host}:{port} within "
                f"{cfg.connect_timeout_s:g}s (nothing accepts connections there): start "
                "`recover coordinator --replicas R --port P` first, or fix "
                "RECOVER_COORDINATOR")
        store = keys.connect_store(host, port, cfg.connect_timeout_s)
        assert cfg.replica is not None  # resolved()
        adopt = invariant.check_join(store, cfg.token, rep.rank, cfg.replica, identity,
                                     None if cfg.init == "off" else rep.module,
                                     cfg.init == "adopt")
        if rep.nranks > 1:  # a replica joins whole: one rank's other state makes all adopt
            t = torch.tensor([float(adopt)], device=rep.grads.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            adopt = bool(t.item())
        if adopt and not cfg.token:
            raise JoinRefused(f"replica {cfg.replica}: init='adopt' takes a running replica's "
                              "state by the authenticated transfer, keyed by the run token: give "
                              "every process the same RECOVER_RUN_TOKEN")
        return adopt

    def adopt(self) -> None:
        """Leave the first generation cleanly and join again as a joiner: a running replica's
        state (parameters, optimizer, step, RNG) replaces this one's before any step here, by
        the authenticated state transfer. The others lose nothing (this replica computed
        nothing; a step planned with it recovers its share)."""
        self.troubled = True
        self.engine.close()
        self.member.leave("adopt")
        self.comm.close()
        deadline = Deadline(self.rep.config.ft.join_timeout_s)
        while True:
            try:
                self.connect()
                break
            except (RunOver, CoordinatorGone):
                raise
            except CoordinatorLost as e:  # our goodbye not yet seen there: "already connected"
                if "already connected" not in str(e) or deadline.passed():
                    raise
                time.sleep(0.1)
        if not self.joined:
            raise JoinRefused(f"replica {self.member.replica}: init='adopt' found no running "
                              "replica to take the state from")
        log.info(f"replica {self.member.replica} rank {self.rep.rank}: adopted a running "
                 f"replica's state at step {self.start_step} ({self.transfer_s:.2f}s transfer)")

    def join(self) -> None:
        """Join; a coordinator that dies meanwhile is waited for (`coordinator_wait_s`)."""
        until = Deadline(self.rep.restart_wait_s)
        while True:
            try:
                self.connect()
                return
            except RunOver:
                raise
            except CoordinatorGone:
                if until.passed():
                    raise
                time.sleep(0.2)

    def connect(self, applied: int = -1, last_generation: int = -1,
                join_timeout_s: float | None = None) -> None:
        """Join the coordinator (a new Member, communicator and step engine); if it makes this
        replica a joiner, receive a running replica's state first (`start_step`, `joined`)."""
        rep, cfg = self.rep, self.rep.config
        if join_timeout_s is not None:
            cfg = replace(cfg, ft=replace(cfg.ft, join_timeout_s=join_timeout_s))
        self.start_step, self.transfer_s, self.joined = 0, 0.0, False

        def receive(member: Member) -> None:
            # A replica started after the run began (a replacement, a torchrun restart, one
            # healed after a coordinator restart) receives a running replica's state and
            # continues from that step (`start_step`).
            self.joined = member.joining
            if self.joined:
                assert cfg.launch is not None  # resolved() sets it
                self.holds_state = False
                self.start_step, self.transfer_s, _ = rejoin.receive(
                    member, rep.rank, rep.module, rep.optimizer, rep.user_state, rep.exact,
                    cfg.ft.join_timeout_s, rep.hooks, cfg.launch.join_at)
                self.holds_state = True

        made: list[Member] = []

        def fenced(why: str) -> None:
            # A hello answered "over" (the run ended before this replica was admitted) may see
            # the run's last generation, without it, before the main thread sees the answer:
            # that is the end of a run this replica came too late for, not a fence.
            if made and made[0].run_over:
                invariant.run_over_exit(RunOver(f"replica {cfg.replica}: the run ended before "
                                                "it was admitted"))
            exit_fenced(why)

        member = new_member(cfg, rep.rank, rep.nranks, applied=applied,
                            last_generation=last_generation, on_fenced=fenced)
        made.append(member)
        # A multi-rank replica's rank 0 speaks for it to the store; its ranks agree through
        # their own group (recovery/speaker.py). The bound: what a speaker learns for them takes
        # at most 2 x 3 reduce timeouts (a decision: its wait, then the evidence's; a chain
        # entry: 3, plus 1 for a scheduled join).
        link = (IntraReplicaLink(member, rep.grads.device, 6 * cfg.ft.reduce_timeout_s + 10,
                                 rep.guard) if rep.nranks > 1 else None)
        # With its ranks' microbatch times agreed (`Replica`'s closing sum), every rank sees the
        # same speeds, so the engine may imply a plan instead of reading it from the store.
        stack = connect_rank(member, rep.grads, rep.n, cfg, hooks=rep.hooks,
                             strategy=rep.strategy, on_joined=receive, shared_speeds=True,
                             link=link)
        engine = stack.engine
        old = getattr(self, "engine", None)
        if old is not None:  # what this replica learned of speeds survives a reconnection
            engine.speeds = old.speeds
            # A rank's own microbatch time only where it is the replica's: the ranks of a
            # multi-rank replica agree on theirs after each step (`Replica`'s closing sum), and
            # a coordinator that died between their commits may have left them apart.
            engine.mb_time = old.mb_time if rep.nranks == 1 else None
        engine.on_join = self._donate
        self.member, self.comm, self.engine = stack.member, stack.comm, engine

    def reconnect(self, applied: int, wait_s: float) -> bool:
        """`Replica.reconnect`: keep this replica's state and join the restarted coordinator at
        the same address within `wait_s`; False if none came back in time; raises
        `CoordinatorLost` if the new coordinator refused this replica."""
        last_gen = self.member.generation()  # kept on failure: it knows the last leader
        self.engine.close()
        self.member.shutdown()
        self.comm.close()
        deadline = Deadline(wait_s)
        while not deadline.passed():
            # A plain probe first: the store client's own retries back off.
            if not poll_until(lambda: _accepts(*self.rep.config.host_port()), deadline, 0.05):
                break
            try:
                # A heal that failed part-way left this state partly overwritten: no step.
                self.connect(applied if self.holds_state else -1, last_gen,
                             max(1.0, deadline.left()))
                return True
            except CoordinatorGone:
                pass  # it died again while we joined: the next one may come
            except CoordinatorLost:
                raise  # refused, or it cannot resume: final
            except (TimeoutError, OSError, RuntimeError):
                pass  # not back yet (the store does not accept connections): try again
            deadline.sleep(0.2)
        return False

    def run(self, step: int, fn: Callable[[int, int], float], round_: int = 0) -> StepResult:
        """One attempt series of the engine; a coordinator's death is waited for and the step
        runs again with its restarted successor (`auto_reconnect`, `coordinator_wait_s` > 0)."""
        rep = self.rep
        while True:
            try:
                return self.engine.run(step, fn, round_)
            except (BelowMinReplicas, RunOver):
                raise
            except (CoordinatorLost, DistError) as e:
                if not rep.auto_reconnect:
                    raise
                if not isinstance(e, CoordinatorLost) and not self._coordinator_died(1.0):
                    raise  # a store error while the coordinator's connection stays up: not ours
                if rep.restart_wait_s <= 0:
                    host, port = rep.config.host_port()
                    raise CoordinatorGoneForGood(
                        f"the coordinator at {host}:{port} is unreachable in step {step} "
                        f"({first_line(e)}): this replica stops; FaultTolerance("
                        "coordinator_wait_s=60) keeps its state for a restarted one "
                        "(`recover coordinator ... --recover`)") from None
                self.troubled = True
                self._rejoin_coordinator(step, e)
                rep.grads.zero()  # the step runs again from nothing with the new engine
                self.member.watch.arm(self.in_step_bound())  # the new member's watchdog

    def in_step_bound(self) -> float:
        """The watchdog's bound inside a step: the fence's, plus 10 of this replica's
        microbatches (slow ones get longer)."""
        return (self.member.fence_after_s or 6.0) + 10 * (self.engine.mb_time or 1.0)

    def _coordinator_died(self, within_s: float) -> bool:
        """Whether the coordinator's liveness connection closed (its process died), waiting up
        to `within_s` for the socket to say so: a store error can be seen first."""
        return poll_until(lambda: self.member.coordinator_lost, within_s, 0.01)

    def _rejoin_coordinator(self, step: int, e: Exception) -> None:
        """Keep this state (`step` applied steps) and join the coordinator's successor."""
        host, port = self.rep.config.host_port()
        why = first_line(e)
        wait_s = self.rep.restart_wait_s
        log.warning(f"the coordinator at {host}:{port} is unreachable ({why}); keeping the state "
                    f"of step {step} and waiting up to {wait_s:g}s for it to restart")
        try:
            back = self.reconnect(step, wait_s)
        except CoordinatorLost as refused:  # the restarted one refused this replica: final
            raise CoordinatorGoneForGood(f"the restarted coordinator at {host}:{port} refused "
                                         f"this replica: {first_line(refused)}") from None
        if not back:
            raise CoordinatorGoneForGood(f"no coordinator came back at {host}:{port} within "
                                         f"{wait_s:g}s ({why})") from None
        if self.joined and self.start_step != step:
            raise Resumed(self.start_step)
        log.info(f"the restarted coordinator resumed the run at step {step}")

    def _donate(self, step: int, join: dict) -> None:
        """The step engine found a join at this step boundary: the donor replica's ranks serve
        the joiner's ranks (rank k to rank k), before anything of step `step` is computed."""
        rep = self.rep
        if int(join["donor"]) == self.member.replica:
            with self.member.watch.paused():  # a big state takes its time; serve() is bounded
                rejoin.serve(self.member, rep.rank, step, join, rep.module, rep.optimizer,
                             rep.user_state, rep.exact, rep.hooks)



def _accepts(host: str, port: int) -> bool:
    """Whether something listens at host:port now (one connect, 0.5 s bound)."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False
