"""`Replica`: the public handle a training loop uses, for any replica layout. Its parts: the
coordinator's connection (`connection`: the join, a restarted coordinator), the planned leave
(`leaving`: SIGTERM), a rank's mesh coordinates (`coords`: loss weight, norm, tied parameters).

Invariant: a replica is the group of ranks in one default process group (one `torchrun` per
replica; `mesh` names its internal dimensions "shard" (FSDP2), "tp" and "pp"). Every rank joins the
coordinator as (replica, rank) and reduces its own local gradient with its own fault-tolerant
communicator at position = its rank, so the cross-replica reduction runs per shard/stage position
and all positions move through the same generations. After `step()` returns, every rank holds
exactly the gradient the same layout would hold without recover: (1/N) x the sum over the step's N
microbatch ids, whoever computed them. The step's loss is the sum over the replica's ranks of each
rank's loss times its weight (1/shards x 1/tp, and 0 except on the last pipeline stage), so it is
the mean microbatch loss whatever the layout. If any intra-replica operation fails (a sibling
rank died) the rank reports its replica lost and waits to be fenced (exit code 3); the survivors
recover the step. A planned leave (`leave_when`) is agreed in the step's closing intra-replica sum,
so every rank of the replica sees `leaving` after the same step, whichever of them was asked.

What a loop of the user's own gets by default (`ReplicaConfig`'s opt-outs; `replica.invariant`):
each `compute(id, j)` runs on RNG state derived from (seed, id), restored after; a process whose
run identity or initial state is not the run's is refused in one line before its hello; one that
cannot reach its coordinator within `connect_timeout_s` gets one line naming the address; a
coordinator that dies mid-step is waited for (`coordinator_wait_s`) and the step runs again with
its restarted successor; a SIGTERM (where the process has no handler) is a planned leave at the
next step boundary, ending the process with exit code 0; one that comes after its run ended
(`RunOver`: the coordinator said so, or its last generation fenced it before the answer was
read) ends with one line and exit code 0. `next_step` is the step this replica's state goes
on with (`epochs`, `recover.replica.epochs`, numbers an epoch loop's steps from it).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from recover.collectives import FaultTolerantComm
from recover.control import CoordinatorLost, Member
from recover.control.member import PREEMPTED
from recover.deadline import Deadline
from recover.layouts.plain import FlatGrads
from recover.layouts.sharded import ShardedGrads, is_dtensor, local_tensor
from recover.recovery import ExactGrads, GradAccess, StepEngine, StepResult, StepStrategy
from recover.replica import coords, invariant
from recover.replica.connection import Connection, Resumed
from recover.replica.epochs import Epochs
from recover.replica.leaving import PlannedLeave
from recover.settings import Hooks, ReplicaConfig

log = logging.getLogger(__name__)

__all__ = ["Replica", "Resumed"]


class Replica:
    """One rank's side of recover: join, then `step()` every iteration, `leave()` at the end.

    `module` holds this rank's parameters (the FSDP2/TP model, or this rank's pipeline stage).
    `tied`: parameters shared between the first and last pipeline stage (e.g. a tied embedding);
    their reduced gradients are summed across the two stages. A joiner mid-run receives, besides
    the module, `optimizer` and `state` (objects with state_dict()/load_state_dict()).
    `config`: where to join and the protocol's settings (default: `ReplicaConfig()`, whose
    coordinator and replica come from the env `RECOVER_COORDINATOR` and `RECOVER_REPLICA`).
    `hooks`: fault injection (tests, `recover train --fault`). `strategy`: the reaction to a lost
    replica (default: in-step recovery). `data`: the run's `IdBatches`, if the loop uses one: its
    identity (items, microbatch size, seed, sampling) is checked at join like N and the model's.
    Raises `JoinRefused` (another run's identity or initial state) or `CoordinatorUnreachable`,
    each one line; uncaught, either ends the process with that line alone (`invariant`).
    """

    def __init__(self, module: nn.Module, microbatches: int, *, mesh: DeviceMesh | None = None,
                 tied: Sequence[nn.Parameter] = (), optimizer: torch.optim.Optimizer | None = None,
                 state: Mapping[str, Any] | None = None, config: ReplicaConfig | None = None,
                 hooks: Hooks | None = None, strategy: StepStrategy | None = None,
                 data: Any = None) -> None:
        invariant.one_line_errors()
        self.module, self.mesh, self.n = module, mesh, microbatches
        self.optimizer, self.user_state = optimizer, dict(state or {})
        self.data = data  # the run's IdBatches (or None): its identity, and `epochs`' lengths
        # The step this replica's state goes on with (`epochs`): start_step after joining, step
        # + 1 after each step, a `Resumed`'s step; and how many `step` calls it has seen.
        self.next_step, self.steps_taken = 0, 0
        self.config = (config or ReplicaConfig()).resolved()
        self.hooks, self.strategy = hooks or Hooks(), strategy
        self._left = False
        # A coordinator that dies mid-step is waited for inside `step` (the app's loop does it
        # itself, to offer its records again, and turns this off).
        self.auto_reconnect = True
        invariant.record_exit_code()
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.rank = dist.get_rank() if mesh is not None else 0
        self.nranks = dist.get_world_size() if mesh is not None else 1
        if mesh is not None and mesh.size() != self.nranks:
            raise ValueError(f"the mesh has {mesh.size()} ranks but the default group (the "
                             f"replica) has {self.nranks}: launch one torchrun per replica")
        # a planned leave (a scheduler's SIGTERM): asked on any rank, agreed by all after a step
        self._planned_leave = PlannedLeave(self.nranks)
        shard, n_shard = coords.coord(mesh, "shard")
        tp, n_tp = coords.coord(mesh, "tp")
        pp, n_pp = coords.coord(mesh, "pp")
        self.first_stage, self.last_stage = pp == 0, pp == n_pp - 1
        # Each rank's loss is its own view (its shard's rows; the whole microbatch under TP; the
        # pipeline's loss on the last stage): weights make the sum over ranks the microbatch loss.
        self.loss_weight = (1.0 / (n_shard * n_tp)) if self.last_stage else 0.0
        tied_ids = {id(p) for p in tied}
        # Count every gradient element once in the norm: replicated copies only at coordinate 0.
        self._norm_owned = [coords.counts_in_norm(p, tp, pp, id(p) in tied_ids)
                            for p in self.params]
        self._tied = [p for p in self.params if id(p) in tied_ids]
        self._tied_group = coords.tied_group(mesh, self.rank) if n_pp > 1 else None
        self.plain = mesh is None and not any(is_dtensor(p) for p in self.params)
        # plain: a flat buffer every .grad views (zero-copy); otherwise the local shards.
        layout: FlatGrads | ShardedGrads = (FlatGrads(module) if self.plain
                                            else ShardedGrads(self.params))
        self.exact: ExactGrads | None = None
        if self.config.numerics.exact:
            coords.check_exact(mesh)
            self.exact = ExactGrads(layout, microbatches)
        self.grads: GradAccess = self.exact or layout
        # > 0: the caller calls `reconnect` when the coordinator dies (see Member.restart_wait_s)
        self.restart_wait_s = self.config.ft.coordinator_wait_s
        # this rank's Member, communicator and step engine, of the coordinator it joined last
        self._connection = Connection(self)
        # The run's identity: an own loop's hello shows its fingerprint (a user's or the app's
        # own fingerprint stays theirs), and the store check names the field that differs.
        self._identity = invariant.identity(module, microbatches, self.config.seed,
                                            self.config.fingerprint, data)
        if self.config.fingerprint == "-":
            self.config = replace(self.config,
                                  fingerprint=invariant.run_fingerprint(self._identity))
        adopt = self._connection.check_join(self._identity)
        self._connection.join()
        if adopt and not self.joined:
            self._connection.adopt()
        self.next_step = self.start_step
        self._planned_leave.install_sigterm(self.config.sigterm_leaves)
        # A clean exit says goodbye even without an explicit leave(), and keeps gloo's groups
        # from being destroyed by the interpreter's teardown (`_at_exit`).
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """At interpreter exit: leave; then, if any reduce of this process ever failed (its gloo
        groups may hold a departed peer's half-done operation), end the process here with the
        exit code it was ending with (`invariant.exit_code`), before the interpreter's teardown.
        Why: destroying such a group there aborts the process ("terminate called without an
        active exception", exit -6), even one with every step applied; the app's worker ends
        with os._exit for the same reason. A multi-rank replica (a `mesh`) ends so too: its own
        gloo group, torn down by the interpreter, can abort a rank whose steps all applied.
        Skipped with it: the atexit handlers registered before this replica was made."""
        self.leave()
        from recover.collectives import reaper

        if self._connection.troubled or reaper.held() or self.mesh is not None:
            logging.shutdown()
            for f in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    f.flush()
            os._exit(invariant.exit_code())

    def reconnect(self, applied: int, wait_s: float) -> bool:
        """The coordinator died: keep this replica's state and join its restarted successor at
        the same address, within `wait_s`. It resumes the run from the last step some replica
        holds whole; a replica behind or ahead of it receives that state first (then `joined`
        and `start_step` say so). False if none came back in time (the caller checkpoints and
        stops); raises `CoordinatorLost` if the new coordinator refused this replica."""
        return self._connection.reconnect(applied, wait_s)

    # -- what the coordinator's connection holds (`recover.replica.connection`) ------------------
    @property
    def member(self) -> Member:
        """This rank's membership in the run (of the coordinator it joined last)."""
        return self._connection.member

    @property
    def comm(self) -> FaultTolerantComm:
        """This rank's cross-replica communicator."""
        return self._connection.comm

    @property
    def engine(self) -> StepEngine:
        """This rank's step engine."""
        return self._connection.engine

    @property
    def joined(self) -> bool:
        """Whether the last join made this replica a joiner (it received a running one's state)."""
        return self._connection.joined

    @property
    def start_step(self) -> int:
        """The step the last join continues from (0, or a joiner's received state's)."""
        return self._connection.start_step

    @property
    def transfer_s(self) -> float:
        """How long the last join's state transfer took (0.0 for none)."""
        return self._connection.transfer_s

    @property
    def holds_state(self) -> bool:
        """False while a state transfer writes into this rank's tensors and after one failed
        part-way: the state is then no run state (a hello claims no step, nothing is saved)
        until a transfer completes (recover.replica.transfer)."""
        return self._connection.holds_state

    # -- the loop ------------------------------------------------------------------------------
    def step(self, step: int, compute: Callable[[int, int], float],
             prefetch: Callable[[int, list[int]], None] | None = None) -> StepResult:
        """Run step `step`: `compute(id, j)` does forward + backward of microbatch `id` with the
        loss scaled by 1/N and returns this rank's (unscaled) loss; on return the gradients are
        the reduced step gradient and `result.loss` is the step's mean loss. In the plain layout
        the reduce starts inside the backward of this replica's last microbatch, in buckets
        (`Numerics.bucket_mb`): `compute` must end with that one backward and leave the gradients
        as it made them (with more than one backward per microbatch, set `bucket_mb=0`).
        `prefetch(next_step, ids)`, if given, runs while the commit decision travels, with the ids
        this rank most likely computes in the next step: load their data there (a guess; nothing
        may be applied there, and `compute` must not rely on it).

        Each `compute(id, j)` runs on the RNG state of (config.seed, id), restored after
        (`ReplicaConfig.id_rng=False`: the caller's own). A coordinator that dies is waited for
        up to `coordinator_wait_s` and the step runs again with its restarted successor (raises
        `Resumed` where that one resumed the run at another step, `CoordinatorLost` where none
        came back). After a SIGTERM handled by the replica's own handler, the call at the next
        step boundary leaves the run (planned) and ends the process with exit code 0."""
        self._may_step(step)
        self.engine.prefetch = prefetch
        self.grads.zero()
        # Inside the step the main thread must keep making progress (every wait in the protocol
        # reports it); a deadlocked one fences itself. The bound grows with slow microbatches.
        in_step = self._connection.in_step_bound()
        self.member.watch.arm(in_step)
        weighted = self._weighted(compute)
        self.steps_taken += 1
        try:
            res = self._connection.run(step, weighted)
        except Resumed as e:  # this state holds another step now: an epoch loop goes on there
            self.next_step = e.step
            raise
        self._connection.troubled |= res.attempts > 1
        round_ = 0
        while res.redo:  # exact mode: some microbatch outgrew the fixed point; wider, again
            round_ += 1
            self.grads.zero()
            if self.nranks > 1:  # the commit moved each rank's own microbatch time: agree again
                with self.guard():
                    self._agree(0.0)
            res = self._connection.run(step, weighted, round_)
        if self.exact is not None:
            res.loss = self.exact.loss / self.n
        # Between steps (the optimizer, the caller's own code) the main thread must be back in
        # `step` within the reduce timeout, the longest the others would wait for it in a reduce:
        # deadlocked there, its live heartbeats kept it a member the others could never reduce
        # with, and every replica failed the next step after 32 rebuilds. Away longer than a
        # whole step's bound it says it is stalled, so the others waiting for it in the next
        # reduce get it evicted then, not after the reduce timeout, unless they themselves spent
        # over a third as long between steps (the same work: `Membership.waiting`).
        # A longer operation that is bounded on its own (a checkpoint save) runs in `busy()`.
        self.member.watch.arm_between(max(self.config.ft.reduce_timeout_s, in_step), in_step)
        if self.nranks > 1:
            with self.guard():
                coords.sum_tied(self._tied, self._tied_group)
                res.loss = self._agree(res.loss, self._planned_leave.asked())
        self.next_step = step + 1
        return res

    def _may_step(self, step: int) -> None:
        """Refuse a step after `leave()`; after a SIGTERM the replica's own handler took, leave
        at this step boundary (planned) and end the process with exit code 0."""
        if self._left:
            raise RuntimeError(f"replica {self.member.replica} left the run (leave()): it "
                               "computes no more steps")
        if self._planned_leave.exits and self.leaving:
            log.warning(f"SIGTERM: replica {self.member.replica} leaves the run at the step "
                        f"boundary before step {step} (planned; the others take its share)")
            self.leave(PREEMPTED)
            raise SystemExit(0)

    def _weighted(self, compute: Callable[[int, int], float]) -> Callable[[int, int], float]:
        """`compute` as the engine calls it: on the id's RNG (unless `id_rng=False`), its loss
        weighted by this rank's share, watched for progress, folded in exact mode."""
        w = self.loss_weight
        devices = invariant.rng_devices() if self.config.id_rng else None
        seed = self.config.seed

        def weighted(i: int, j: int) -> float:
            self.member.watch.progress()
            with self.guard():
                if devices is None:
                    loss = w * compute(i, j)
                else:
                    with invariant.id_rng(seed, i, devices):
                        loss = w * compute(i, j)
            self.member.watch.progress()
            if self.exact is not None:  # into the fixed-point sum, before the next microbatch
                self.exact.fold(loss)
            return loss

        return weighted

    def epochs(self, count: int, steps_per_epoch: int | None = None) -> Epochs:
        """An epoch-style loop over this run's steps, for a loop ported from a `DataLoader`:
        `for epoch, steps in rep.epochs(E):` then `for step in steps: rep.step(step, compute)`.
        It starts at this replica's `next_step` (a joiner's `start_step`), and the code after an
        epoch's last step runs with the watchdog paused (`recover.replica.epochs`). The epoch's
        length comes from `data=IdBatches` (every item once), else `steps_per_epoch`."""
        return Epochs(self, count, steps_per_epoch)

    def pause_watchdog(self) -> None:
        """Until the next `step`: this process's main thread is in work of its own that is
        bounded on its own (`busy()` without a `with`; the next step arms the watchdog again)."""
        self.member.watch.disarm()

    @property
    def leaving(self) -> bool:
        """Whether to leave at this step boundary (`leave_when`): one rank asks itself; the
        ranks of a multi-rank replica use what they agreed after the last step, all alike."""
        return self._planned_leave.leaving

    def leave_when(self, asked: threading.Event) -> None:
        """Leave at a step boundary once `asked` is set (e.g. by a SIGTERM handler) on any rank
        of this replica: `leaving` turns True on every rank after the same step (the caller
        then calls `leave(reason)`). Why agreed: ranks are signalled at different moments, and
        one that went on into the next step alone would lose the whole replica as a crash.
        Replaces the replica's own SIGTERM handler, if it installed one."""
        self._planned_leave.when(asked)

    def _agree(self, loss: float, asked: bool = False) -> float:
        """Sum the ranks' weighted losses, and give every rank of the replica the same seconds
        per microbatch (their mean, in whole microseconds so the sum is exact in any order):
        the next reduce's trailer then carries one speed per replica at every position. Also
        whether any rank was asked to leave (`leaving`: the same answer on every rank)."""
        mine = self.engine.mb_time
        t = torch.tensor([loss, round(mine * 1e6) if mine is not None else 0,
                          mine is not None, asked], dtype=torch.float64,
                         device=self.grads.device)
        dist.all_reduce(t)
        total, us, have, leave = t.tolist()
        self.engine.mb_time = us / self.nranks / 1e6 if int(have) == self.nranks else None
        self._planned_leave.agreed = leave > 0
        return total

    def replica_sum(self, value: float) -> float:
        """Sum a float over this replica's ranks (e.g. weighted per-rank losses); the value itself
        for a one-rank replica. An intra-replica collective: call it inside `guard()`."""
        if self.nranks == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.grads.device)
        dist.all_reduce(t)
        return float(t)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the replica's whole gradient (all ranks) to `max_norm`; return its norm."""
        if self.plain:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        sq = coords.owned_sq_sum(self.params, self._norm_owned, self.grads.device)
        if self.nranks > 1:
            with self.guard():
                dist.all_reduce(sq)
        norm = math.sqrt(float(sq))
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        return norm

    def leave(self, reason: str = "") -> None:
        """Say goodbye to the coordinator (a clean exit is not a fault); idempotent, and also
        run at interpreter exit. Called between steps (a planned leave, `reason` e.g.
        "preempted"), the coordinator publishes a generation without this replica and the next
        step's ids go to the others: nothing this replica reduced is computed again."""
        if not self._left:
            self._left = True
            self.member.watch.disarm()
            self.engine.close()  # after the deletions already queued
            self.member.leave(reason.split()[0] if reason.split() else "")

    @property
    def replica(self) -> int:
        """This replica's id (0..R-1)."""
        return self.member.replica

    @property
    def generation(self) -> int:
        """The newest membership generation known here."""
        return self.member.generation()

    @property
    def members(self) -> list[int]:
        """The live replicas of the newest generation."""
        return self.member.members()

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counters of the step protocol and of this rank's communicator."""
        return {**self.engine.stats, **{f"comm_{k}": v for k, v in self.comm.stats.items()}}

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the lowest live replica (writes records and checkpoints)."""
        return self.rank == 0 and min(self.member.members()) == self.member.replica

    # -- what a checkpoint holds of it (torch.distributed.checkpoint's `Stateful`) ---------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """What this rank holds, beyond the module and optimizer, that a resume needs to go on
        exactly as the run would have: exact mode's agreed maxima (the next step's exponents);
        nothing in the default mode. Put the replica in your checkpoint's state dict
        (`dcp.save({..., "replica": rep})`). The key names this rank: the shards of one replica
        hold different maxima, so a save keeps every rank's and a load gives each its own."""
        if self.exact is None:
            return {}
        return {self._exact_key(): torch.tensor(self.exact.max_seen, dtype=torch.float64)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt a checkpoint's `state_dict()`: in exact mode this rank's maxima, which it must
        hold (a checkpoint of the default mode, or of another layout, is refused in one line)."""
        if self.exact is None:
            return
        maxima = state.get(self._exact_key())
        if maxima is None or len(maxima) != len(self.exact.max_seen):
            raise ValueError(
                f"replica {self.member.replica} rank {self.rank}: the checkpoint holds no exact-"
                f"mode exponents for this rank ({len(self.exact.max_seen)} expected under "
                f"{self._exact_key()!r}; it has {sorted(state)}): it was saved in the default "
                "mode or by another layout")
        self.exact.set_maxima([float(v) for v in maxima])

    def _exact_key(self) -> str:
        return f"exact_max_rank{self.rank}"

    @contextmanager
    def busy(self) -> Iterator[None]:
        """A long operation between steps that is bounded on its own (a checkpoint save): the
        stuck-thread watchdog armed after each step pauses meanwhile."""
        with self.member.watch.paused():
            yield

    @contextmanager
    def guard(self, wait_s: float = 30.0) -> Iterator[None]:
        """Any error inside (an intra-replica collective whose peer died) loses this replica:
        report it and wait to be fenced, so the survivors can go on without us. The error is
        what leaves, even when the coordinator is gone meanwhile: a rank of a lost replica must
        not wait to rejoin a restarted coordinator (that would hold it for coordinator_wait_s,
        and its replacement as long)."""
        try:
            yield
        except Exception:
            log.error(f"replica {self.member.replica} rank {self.rank}: intra-replica failure; "
                      "reporting the replica lost:\n" + traceback.format_exc(limit=3))
            self.member.report_lost(f"rank {self.rank} (pid {os.getpid()}) failed")
            g = self.member.generation()
            deadline = Deadline(wait_s)
            while not deadline.passed():  # the Member's thread exits us once fenced
                try:
                    g = self.member.wait_newer(g, max(0.01, deadline.left()))
                except (TimeoutError, CoordinatorLost):
                    break
            raise
