"""`Replica`: the public handle a training loop uses, for any replica layout.

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

What a loop of the user's own gets by default (`ReplicaConfig`'s opt-outs; `parallel.invariant`):
each `compute(id, j)` runs on RNG state derived from (seed, id), restored after; a process whose
run identity or initial state is not the run's is refused in one line before its hello; one that
cannot reach its coordinator within `connect_timeout_s` gets one line naming the address; a
coordinator that dies mid-step is waited for (`coordinator_wait_s`) and the step runs again with
its restarted successor; a SIGTERM (where the process has no handler) is a planned leave at the
next step boundary, ending the process with exit code 0; one that comes after its run ended
(`RunOver`: the coordinator said so, or its last generation fenced it before the answer was
read) ends with one line and exit code 0. `next_step` is the step this replica's state goes
on with (`epochs`, `recover.parallel.epochs`, numbers an epoch loop's steps from it).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import DistError
from torch.distributed.device_mesh import DeviceMesh

from recover.collectives import CoordinatorGone, CoordinatorLost, Member, RunOver, keys
from recover.collectives.member import exit_fenced
from recover.errors import RecoverError
from recover.parallel import invariant, rejoin
from recover.parallel.epochs import Epochs
from recover.parallel.grads import ShardedGrads, is_dtensor, local_tensor
from recover.parallel.invariant import CoordinatorUnreachable, JoinRefused
from recover.parallel.link import IntraReplicaLink
from recover.parallel.plain import FlatGrads
from recover.parallel.rank import connect_rank, new_member
from recover.recovery import BelowMinReplicas, ExactGrads, GradAccess, StepResult, StepStrategy
from recover.settings import Hooks, ReplicaConfig

log = logging.getLogger(__name__)

__all__ = ["CoordinatorGoneForGood", "CoordinatorUnreachable", "JoinRefused", "Replica",
           "Resumed"]


class CoordinatorGoneForGood(RecoverError):
    """The coordinator went away mid-run and none came back (or none was waited for): this
    replica stops; one line says where it was and how to wait for a restarted one."""


class Resumed(CoordinatorLost):
    """A restarted coordinator resumed the run at another step than the one this replica was in
    (it was one step behind or ahead when the old one died), and this replica received that
    state: the module and optimizer now hold `step` applied steps. Go on with `rep.step(step)`."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the restarted coordinator resumed the run at step {step}: this "
                         f"replica now holds that state; continue the loop from step {step}")
        self.step = step


def _coord(mesh: DeviceMesh | None, dim: str) -> tuple[int, int]:
    """(this rank's coordinate, size) along a named mesh dimension; (0, 1) if absent."""
    if mesh is None or dim not in (mesh.mesh_dim_names or ()):
        return 0, 1
    return mesh.get_local_rank(dim), mesh.size(mesh.mesh_dim_names.index(dim))


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
        self._exit_on_leave = False  # our own SIGTERM handler asked: `step` ends the process
        self._troubled = False  # a reduce failed here once: end without teardown (`_at_exit`)
        invariant.record_exit_code()
        # a planned leave (a scheduler's SIGTERM): asked on any rank, agreed by all after a step
        self._leave_asked: threading.Event | None = None
        self._leave_agreed = False
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.rank = dist.get_rank() if mesh is not None else 0
        self.nranks = dist.get_world_size() if mesh is not None else 1
        if mesh is not None and mesh.size() != self.nranks:
            raise ValueError(f"the mesh has {mesh.size()} ranks but the default group (the "
                             f"replica) has {self.nranks}: launch one torchrun per replica")
        shard, n_shard = _coord(mesh, "shard")
        tp, n_tp = _coord(mesh, "tp")
        pp, n_pp = _coord(mesh, "pp")
        self.first_stage, self.last_stage = pp == 0, pp == n_pp - 1
        # Each rank's loss is its own view (its shard's rows; the whole microbatch under TP; the
        # pipeline's loss on the last stage): weights make the sum over ranks the microbatch loss.
        self.loss_weight = (1.0 / (n_shard * n_tp)) if self.last_stage else 0.0
        tied_ids = {id(p) for p in tied}
        # Count every gradient element once in the norm: replicated copies only at coordinate 0.
        self._norm_owned = [self._owned(p, tp, pp, id(p) in tied_ids) for p in self.params]
        self._tied = [p for p in self.params if id(p) in tied_ids]
        self._tied_group = self._tied_groups(mesh) if n_pp > 1 else None
        self.plain = mesh is None and not any(is_dtensor(p) for p in self.params)
        # plain: a flat buffer every .grad views (zero-copy); otherwise the local shards.
        layout: FlatGrads | ShardedGrads = (FlatGrads(module) if self.plain
                                            else ShardedGrads(self.params))
        self.exact: ExactGrads | None = None
        if self.config.numerics.exact:
            _check_exact(mesh)
            self.exact = ExactGrads(layout, microbatches)
        self.grads: GradAccess = self.exact or layout
        # > 0: the caller calls `reconnect` when the coordinator dies (see Member.restart_wait_s)
        self.restart_wait_s = self.config.ft.coordinator_wait_s
        # False while a state transfer writes into this rank's tensors and after one failed
        # part-way: the state is then no run state (a hello claims no step, nothing is saved)
        # until a transfer completes (recover.parallel.transfer).
        self.holds_state = True
        # The run's identity: an own loop's hello shows its fingerprint (a user's or the app's
        # own fingerprint stays theirs), and the store check names the field that differs.
        self._identity = invariant.identity(module, microbatches, self.config.seed,
                                            self.config.fingerprint, data)
        if self.config.fingerprint == "-":
            self.config = replace(self.config,
                                  fingerprint=invariant.run_fingerprint(self._identity))
        adopt = self._check_join()
        self._join()
        if adopt and not self.joined:
            self._adopt()
        self.next_step = self.start_step
        self._install_sigterm()
        # A clean exit says goodbye even without an explicit leave(), and keeps gloo's groups
        # from being destroyed by the interpreter's teardown (`_at_exit`).
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """At interpreter exit: leave; then, if any reduce of this process ever failed (its gloo
        groups may hold a departed peer's half-done operation), end the process here with the
        exit code it was ending with (`invariant.exit_code`), before the interpreter's teardown.
        Why: destroying such a group there aborts the process ("terminate called without an
        active exception", exit -6: seen after a replica adopted state, with every step
        applied); the app's worker ends with os._exit for the same reason. Skipped with it:
        the atexit handlers registered before this replica was made."""
        self.leave()
        from recover.collectives import reaper

        if self._troubled or reaper.held():
            logging.shutdown()
            for f in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    f.flush()
            os._exit(invariant.exit_code())

    def _check_join(self) -> bool:
        """Before the hello: reach the coordinator within `connect_timeout_s` (else one line
        naming its address), then compare this rank's identity and initial state with the
        run's (`invariant.check_join`). True: this replica takes a running one's state
        (`init="adopt"`, agreed by its ranks)."""
        cfg = self.config
        host, port = cfg.host_port()
        deadline = time.monotonic() + cfg.connect_timeout_s
        while not _accepts(host, port):
            if time.monotonic() > deadline:
                raise CoordinatorUnreachable(
                    f"cannot reach the recover coordinator at {host}:{port} within "
                    f"{cfg.connect_timeout_s:g}s (nothing accepts connections there): start "
                    "`recover coordinator --replicas R --port P` first, or fix "
                    "RECOVER_COORDINATOR")
            time.sleep(0.1)
        store = keys.connect_store(host, port, cfg.connect_timeout_s)
        assert cfg.replica is not None  # resolved()
        adopt = invariant.check_join(store, cfg.token, self.rank, cfg.replica, self._identity,
                                     None if cfg.init == "off" else self.module,
                                     cfg.init == "adopt")
        if self.nranks > 1:  # a replica joins whole: one rank's other state makes all adopt
            t = torch.tensor([float(adopt)], device=self.grads.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            adopt = bool(t.item())
        if adopt and not cfg.token:
            raise JoinRefused(f"replica {cfg.replica}: init='adopt' takes a running replica's "
                              "state by the authenticated transfer, keyed by the run token: give "
                              "every process the same RECOVER_RUN_TOKEN")
        return adopt

    def _adopt(self) -> None:
        """Leave the first generation cleanly and join again as a joiner: a running replica's
        state (parameters, optimizer, step, RNG) replaces this one's before any step here, by
        the authenticated state transfer. The others lose nothing (this replica computed
        nothing; a step planned with it recovers its share)."""
        self._troubled = True
        self.engine.close()
        self.member.leave("adopt")
        self.comm.close()
        deadline = time.monotonic() + self.config.ft.join_timeout_s
        while True:
            try:
                self._connect()
                break
            except (RunOver, CoordinatorGone):
                raise
            except CoordinatorLost as e:  # our goodbye not yet seen there: "already connected"
                if "already connected" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        if not self.joined:
            raise JoinRefused(f"replica {self.replica}: init='adopt' found no running replica "
                              "to take the state from")
        log.info(f"replica {self.replica} rank {self.rank}: adopted a running replica's state "
                 f"at step {self.start_step} ({self.transfer_s:.2f}s transfer)")

    def _join(self) -> None:
        """Join; a coordinator that dies meanwhile is waited for (`coordinator_wait_s`)."""
        until = time.monotonic() + self.restart_wait_s
        while True:
            try:
                self._connect()
                return
            except RunOver:
                raise
            except CoordinatorGone:
                if time.monotonic() >= until:
                    raise
                time.sleep(0.2)

    def _install_sigterm(self) -> None:
        """SIGTERM as a planned leave at the next step boundary, where the process has no
        handler of its own (and only from the main thread: `signal` allows no other). A second
        SIGTERM takes the default action (the process ends, as killed)."""
        if (not self.config.sigterm_leaves or self._leave_asked is not None
                or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)):
            return
        asked = threading.Event()

        def handle(signum: int, frame: Any) -> None:  # flags only: it runs between bytecodes
            if asked.is_set():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            asked.set()

        signal.signal(signal.SIGTERM, handle)
        self._leave_asked, self._exit_on_leave = asked, True
        self._sigterm_handler = handle

    def _connect(self, applied: int = -1, last_generation: int = -1,
                 join_timeout_s: float | None = None) -> None:
        """Join the coordinator (a new Member, communicator and step engine); if it makes this
        replica a joiner, receive a running replica's state first (`start_step`, `joined`)."""
        cfg = self.config
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
                    member, self.rank, self.module, self.optimizer, self.user_state, self.exact,
                    cfg.ft.join_timeout_s, self.hooks, cfg.launch.join_at)
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

        member = new_member(cfg, self.rank, self.nranks, applied=applied,
                            last_generation=last_generation, on_fenced=fenced)
        made.append(member)
        # A multi-rank replica's rank 0 speaks for it to the store; its ranks agree through
        # their own group (recovery/speaker.py). The bound: what a speaker learns for them takes
        # at most 2 x 3 reduce timeouts (a decision: its wait, then the evidence's; a chain
        # entry: 3, plus 1 for a scheduled join).
        link = (IntraReplicaLink(member, self.grads.device, 6 * cfg.ft.reduce_timeout_s + 10,
                                 self.guard) if self.nranks > 1 else None)
        # With its ranks' microbatch times agreed (`_agree`), every rank sees the same speeds,
        # so the engine may imply a plan instead of reading it from the store.
        stack = connect_rank(member, self.grads, self.n, cfg, hooks=self.hooks,
                             strategy=self.strategy, on_joined=receive, shared_speeds=True,
                             link=link)
        engine = stack.engine
        old = getattr(self, "engine", None)
        if old is not None:  # what this replica learned of speeds survives a reconnection
            engine.speeds = old.speeds
            # A rank's own microbatch time only where it is the replica's: the ranks of a
            # multi-rank replica agree on theirs after each step (`_agree`), and a coordinator
            # that died between their commits may have left them apart.
            engine.mb_time = old.mb_time if self.nranks == 1 else None
        engine.on_join = self._donate
        self.member, self.comm, self.engine = stack.member, stack.comm, engine

    def reconnect(self, applied: int, wait_s: float) -> bool:
        """The coordinator died: keep this replica's state and join its restarted successor at
        the same address, within `wait_s`. It resumes the run from the last step some replica
        holds whole; a replica behind or ahead of it receives that state first (then `joined`
        and `start_step` say so). False if none came back in time (the caller checkpoints and
        stops); raises `CoordinatorLost` if the new coordinator refused this replica."""
        last_gen = self.member.generation()  # kept on failure: it knows the last leader
        self.engine.close()
        self.member.shutdown()
        self.comm.close()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _accepts(*self.config.host_port()):
                time.sleep(0.05)  # a plain probe: the store client's own retries back off
                continue
            try:
                # A heal that failed part-way left this state partly overwritten: no step.
                self._connect(applied if self.holds_state else -1, last_gen,
                              max(1.0, deadline - time.monotonic()))
                return True
            except CoordinatorGone:
                pass  # it died again while we joined: the next one may come
            except CoordinatorLost:
                raise  # refused, or it cannot resume: final
            except (TimeoutError, OSError, RuntimeError):
                pass  # not back yet (the store does not accept connections): try again
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return False

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
        in_step = self._in_step_bound()
        self.member.watch.arm(in_step)
        weighted = self._weighted(compute)
        self.steps_taken += 1
        try:
            res = self._run(step, weighted)
        except Resumed as e:  # this state holds another step now: an epoch loop goes on there
            self.next_step = e.step
            raise
        self._troubled |= res.attempts > 1
        round_ = 0
        while res.redo:  # exact mode: some microbatch outgrew the fixed point; wider, again
            round_ += 1
            self.grads.zero()
            if self.nranks > 1:  # the commit moved each rank's own microbatch time: agree again
                with self.guard():
                    self._agree(0.0)
            res = self._run(step, weighted, round_)
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
                self._sum_tied()
                res.loss = self._agree(res.loss, self._asked())
        self.next_step = step + 1
        return res

    def _may_step(self, step: int) -> None:
        """Refuse a step after `leave()`; after a SIGTERM the replica's own handler took, leave
        at this step boundary (planned) and end the process with exit code 0."""
        if self._left:
            raise RuntimeError(f"replica {self.member.replica} left the run (leave()): it "
                               "computes no more steps")
        if self._exit_on_leave and self.leaving:
            log.warning(f"SIGTERM: replica {self.member.replica} leaves the run at the step "
                        f"boundary before step {step} (planned; the others take its share)")
            self.leave("preempted")
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
        epoch's last step runs with the watchdog paused (`recover.parallel.epochs`). The epoch's
        length comes from `data=IdBatches` (every item once), else `steps_per_epoch`."""
        return Epochs(self, count, steps_per_epoch)

    def pause_watchdog(self) -> None:
        """Until the next `step`: this process's main thread is in work of its own that is
        bounded on its own (`busy()` without a `with`; the next step arms the watchdog again)."""
        self.member.watch.disarm()

    def _run(self, step: int, fn: Callable[[int, int], float], round_: int = 0) -> StepResult:
        """One attempt series of the engine; a coordinator's death is waited for and the step
        runs again with its restarted successor (`auto_reconnect`, `coordinator_wait_s` > 0)."""
        while True:
            try:
                return self.engine.run(step, fn, round_)
            except (BelowMinReplicas, RunOver):
                raise
            except (CoordinatorLost, DistError) as e:
                if not self.auto_reconnect or isinstance(e, RecoverError):
                    raise
                if not isinstance(e, CoordinatorLost) and not self._coordinator_died(1.0):
                    raise  # a store error while the coordinator's connection stays up: not ours
                if self.restart_wait_s <= 0:
                    host, port = self.config.host_port()
                    raise CoordinatorGoneForGood(
                        f"the coordinator at {host}:{port} is unreachable in step {step} "
                        f"({_first_line(e)}): this replica stops; FaultTolerance("
                        "coordinator_wait_s=60) keeps its state for a restarted one "
                        "(`recover coordinator ... --recover`)") from None
                self._troubled = True
                self._rejoin_coordinator(step, e)
                self.grads.zero()  # the step runs again from nothing with the new engine
                self.member.watch.arm(self._in_step_bound())  # the new member's watchdog

    def _coordinator_died(self, within_s: float) -> bool:
        """Whether the coordinator's liveness connection closed (its process died), waiting up
        to `within_s` for the socket to say so: a store error can be seen first."""
        deadline = time.monotonic() + within_s
        while not self.member.coordinator_lost:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _rejoin_coordinator(self, step: int, e: Exception) -> None:
        """Keep this state (`step` applied steps) and join the coordinator's successor."""
        host, port = self.config.host_port()
        why = _first_line(e)
        wait_s = self.restart_wait_s
        log.warning(f"the coordinator at {host}:{port} is unreachable ({why}); keeping the state "
                    f"of step {step} and waiting up to {wait_s:g}s for it to restart")
        try:
            back = self.reconnect(step, wait_s)
        except CoordinatorLost as refused:  # the restarted one refused this replica: final
            raise CoordinatorGoneForGood(f"the restarted coordinator at {host}:{port} refused "
                                         f"this replica: {_first_line(refused)}") from None
        if not back:
            raise CoordinatorGoneForGood(f"no coordinator came back at {host}:{port} within "
                                         f"{wait_s:g}s ({why})") from None
        if self.joined and self.start_step != step:
            raise Resumed(self.start_step)
        log.info(f"the restarted coordinator resumed the run at step {step}")

    def _in_step_bound(self) -> float:
        """The watchdog's bound inside a step: the fence's, plus 10 of this replica's
        microbatches (slow ones get longer)."""
        return (self.member.fence_after_s or 6.0) + 10 * (self.engine.mb_time or 1.0)

    def _asked(self) -> bool:
        return self._leave_asked is not None and self._leave_asked.is_set()

    @property
    def leaving(self) -> bool:
        """Whether to leave at this step boundary (`leave_when`): one rank asks itself; the
        ranks of a multi-rank replica use what they agreed after the last step, all alike."""
        return self._asked() if self.nranks == 1 else self._leave_agreed

    def leave_when(self, asked: threading.Event) -> None:
        """Leave at a step boundary once `asked` is set (e.g. by a SIGTERM handler) on any rank
        of this replica: `leaving` turns True on every rank after the same step (the caller
        then calls `leave(reason)`). Why agreed: ranks are signalled at different moments, and
        one that went on into the next step alone would lose the whole replica as a crash.
        Replaces the replica's own SIGTERM handler, if it installed one."""
        if self._exit_on_leave and signal.getsignal(signal.SIGTERM) is getattr(
                self, "_sigterm_handler", None):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._leave_asked, self._exit_on_leave = asked, False

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
        self._leave_agreed = leave > 0
        return total

    def _donate(self, step: int, join: dict) -> None:
        """The step engine found a join at this step boundary: the donor replica's ranks serve
        the joiner's ranks (rank k to rank k), before anything of step `step` is computed."""
        if int(join["donor"]) == self.replica:
            with self.member.watch.paused():  # a big state takes its time; serve() is bounded
                rejoin.serve(self.member, self.rank, step, join, self.module, self.optimizer,
                             self.user_state, self.exact, self.hooks)

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
        owned = [local_tensor(p.grad) for p, o in zip(self.params, self._norm_owned, strict=True)
                 if o and p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.grads.device)
        for g in owned:
            sq += g.double().pow(2).sum()
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
        not wait to rejoin a restarted coordinator (a soak run held one 60 s, and its
        replacement as long)."""
        try:
            yield
        except Exception:
            log.error(f"replica {self.member.replica} rank {self.rank}: intra-replica failure; "
                      "reporting the replica lost:\n" + traceback.format_exc(limit=3))
            self.member.report_lost(f"rank {self.rank} (pid {os.getpid()}) failed")
            g = self.member.generation()
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:  # the Member's thread exits us once fenced
                try:
                    g = self.member.wait_newer(g, max(0.01, deadline - time.monotonic()))
                except (TimeoutError, CoordinatorLost):
                    break
            raise

    # -- internals -----------------------------------------------------------------------------
    def _owned(self, p: nn.Parameter, tp: int, pp: int, tied: bool) -> bool:
        if tied and pp != 0:
            return False
        if is_dtensor(p):
            from torch.distributed.tensor import Replicate

            for d, pl in enumerate(p.placements):
                if isinstance(pl, Replicate) and p.device_mesh.get_local_rank(d) != 0:
                    return False
            return True
        return tp == 0  # a plain tensor in a TP replica is a replicated copy

    def _tied_groups(self, mesh: DeviceMesh) -> dist.ProcessGroup | None:
        """One group per pipeline line: {first stage, last stage} at the same other coordinates;
        built on every rank in the same order (new_group is collective)."""
        names = list(mesh.mesh_dim_names)
        grid = mesh.mesh.movedim(names.index("pp"), 0)
        grid = grid.reshape(grid.shape[0], -1)
        mine = None
        for c in range(grid.shape[1]):
            ranks = sorted({int(grid[0, c]), int(grid[-1, c])})
            g = dist.new_group(ranks)
            if self.rank in ranks:
                mine = g
        return mine

    def _sum_tied(self) -> None:
        if not self._tied or self._tied_group is None:
            return
        for p in self._tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(local_tensor(p.grad), group=self._tied_group)


def _check_exact(mesh: DeviceMesh | None) -> None:
    """Exact mode needs each microbatch's gradient to be a pure function of its id wherever it
    runs: deterministic kernels, one intra-op thread on CPU (a reduction split over threads
    sums in another order), and the same layout on every replica (plain or hsdp)."""
    names = set(mesh.mesh_dim_names or ()) if mesh is not None else set()
    if names - {"shard"}:
        raise ValueError(f"exact mode supports plain and hsdp replicas, not a mesh with "
                         f"{sorted(names)}")
    if torch.get_num_threads() != 1:
        raise ValueError(f"exact mode needs torch.set_num_threads(1) (now "
                         f"{torch.get_num_threads()}): CPU reductions split over threads sum "
                         "in a thread-count-dependent order")
    # cuBLAS needs a fixed workspace to be deterministic (its documented requirement).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    # Not its filling of every new tensor with NaN, a debugging aid for code that reads memory
    # it never wrote (no torch kernel does): 2-3 % of a small-preset forward + backward on CPU.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e).strip() else type(e).__name__


def _accepts(host: str, port: int) -> bool:
    """Whether something listens at host:port now (one connect, 0.5 s bound)."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False

