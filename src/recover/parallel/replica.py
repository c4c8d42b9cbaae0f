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
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
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
from torch.distributed.device_mesh import DeviceMesh

from recover.collectives import CoordinatorGone, CoordinatorLost, Member
from recover.parallel import rejoin
from recover.parallel.grads import ShardedGrads, is_dtensor, local_tensor
from recover.parallel.link import IntraReplicaLink
from recover.parallel.plain import FlatGrads
from recover.parallel.rank import connect_rank, new_member
from recover.recovery import ExactGrads, GradAccess, StepResult, StepStrategy
from recover.settings import Hooks, ReplicaConfig

log = logging.getLogger(__name__)


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
    replica (default: in-step recovery).
    """

    def __init__(self, module: nn.Module, microbatches: int, *, mesh: DeviceMesh | None = None,
                 tied: Sequence[nn.Parameter] = (), optimizer: torch.optim.Optimizer | None = None,
                 state: Mapping[str, Any] | None = None, config: ReplicaConfig | None = None,
                 hooks: Hooks | None = None, strategy: StepStrategy | None = None) -> None:
        self.module, self.mesh, self.n = module, mesh, microbatches
        self.optimizer, self.user_state = optimizer, dict(state or {})
        self.config = (config or ReplicaConfig()).resolved()
        self.hooks, self.strategy = hooks or Hooks(), strategy
        self._left = False
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
        self._connect()
        atexit.register(self.leave)  # a clean exit says goodbye even without an explicit leave()

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

        member = new_member(cfg, self.rank, self.nranks, applied=applied,
                            last_generation=last_generation)
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
        may be applied there, and `compute` must not rely on it)."""
        self.engine.prefetch = prefetch
        self.grads.zero()
        w = self.loss_weight
        # Inside the step the main thread must keep making progress (every wait in the protocol
        # reports it); a deadlocked one fences itself. The bound grows with slow microbatches.
        in_step = self._in_step_bound()
        self.member.watch.arm(in_step)

        def weighted(i: int, j: int) -> float:
            self.member.watch.progress()
            with self.guard():
                loss = w * compute(i, j)
            self.member.watch.progress()
            if self.exact is not None:  # into the fixed-point sum, before the next microbatch
                self.exact.fold(loss)
            return loss

        res = self.engine.run(step, weighted)
        round_ = 0
        while res.redo:  # exact mode: some microbatch outgrew the fixed point; wider, again
            round_ += 1
            self.grads.zero()
            if self.nranks > 1:  # the commit moved each rank's own microbatch time: agree again
                with self.guard():
                    self._agree(0.0)
            res = self.engine.run(step, weighted, round_)
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
        return res

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
        one that went on into the next step alone would lose the whole replica as a crash."""
        self._leave_asked = asked

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


def _accepts(host: str, port: int) -> bool:
    """Whether something listens at host:port now (one connect, 0.5 s bound)."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False

