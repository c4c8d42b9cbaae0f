"""One rank of one replica: the reference trainer's loop, top to bottom, for every layout.

Invariant: the parameters after step t depend only on the config and on the N microbatch ids of
steps 0..t, never on how many replicas computed them or which ones died: each microbatch's data
and dropout come from its id, the gradient is the sum of per-microbatch gradients / N, and the
optimizer runs only after the step's commit decision (`recover.Replica.step`). A checkpoint is
labelled with the number of optimizer steps it holds, whatever path saves it.

Read `run` first: it builds a `Trainer` (model, optimizer, checkpoints, faults), joins, trains to
the end, and turns each way a run can stop into its exit code. `Trainer.train` is the loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import TextIO

import torch
from torch.distributed import DistError

from recover.app import rundir
from recover.app.config import CheckedConfig, RunConfig, replica_config
from recover.app.faults import FaultInjector
from recover.app.runtoken import run_token
from recover.app.train import foreign, layout
from recover.app.train.checkpoint.ranks import EXACT_MAX, RankCheckpoints
from recover.app.train.data import eval_batches, load_data, train_batches
from recover.app.train.metrics import StepTimer, seal_record, step_record
from recover.app.train.optim import build_optimizer, lr_at, set_lr
from recover.app.train.preempt import Preemption, die_by_sigterm
from recover.app.train.progress import Eta, step_line
from recover.control import CoordinatorGone, CoordinatorLost, GlooInterfaceError, RunOver, keys
from recover.control.member import PREEMPTED
from recover.deadline import Deadline
from recover.errors import ExitCode, first_line
from recover.recovery import BelowMinReplicas, ExactOverflow, StepResult, StepStrategy
from recover.replica import Replica
from recover.replica.digest import replica_digest
from recover.settings import LaunchEnv
from recover.workload import Stream, id_seed

log = logging.getLogger(__name__)
RECORDS_KEPT = 256  # offered again to a restarted coordinator (the launcher may not have read them)
PROGRESS_LINES = 100  # a run logs about this many per-step progress lines (and every recovery)


def run(run_dir: Path, replica: int, rank: int, host: str, port: int,
        config: CheckedConfig | None = None) -> int:
    """Train this rank of `replica` to the run's end; the process's exit code. `config`: the
    run's config.json as the worker checked it (None: read and checked here)."""
    # One intra-op thread: more oversubscribe the cores the replicas share, and every process
    # slows (docs/MEASUREMENTS.md, "Threads and start-up").
    torch.set_num_threads(1)
    if config is None:
        config = RunConfig.load(run_dir / rundir.CONFIG).checked()
    cfg = config.cfg
    try:
        trainer = Trainer(run_dir, config, replica, rank, f"{host}:{port}")
    except CoordinatorLost as e:  # another run's coordinator, or this rank runs already
        log.error(f"cannot join: {e}")
        return ExitCode.USAGE
    # SIGTERM on any rank: the replica's ranks leave together after the same step (agreed)
    trainer.preempt.install()
    try:
        if not trainer.join():
            return ExitCode.USAGE
    except RunOver as e:  # a replacement started too late to be needed: nothing failed
        log.info(f"leaving: {e}")
        return ExitCode.OK
    end = cfg.run.stop_at or cfg.run.steps
    while True:  # once, unless the coordinator dies and a restarted one takes over
        try:
            if trainer.train(end):
                return trainer.stop_preempted()
            break
        except BelowMinReplicas as e:
            return trainer.stop_below_min(e)
        except GlooInterfaceError as e:  # a configuration error, not a fault: one line
            log.error(f"stopping: {e}")
            return ExitCode.USAGE  # without leave(): the coordinator records the replica as lost
        except ExactOverflow as e:  # training diverged (every replica sees the same step)
            log.error(f"stopping: {e}")
            return ExitCode.ERROR
        except (CoordinatorLost, DistError) as e:  # the store went away with the coordinator
            if not trainer.rejoin_coordinator(e, end):
                return trainer.stop_coordinator_lost(e, end)
    trainer.finish()
    return ExitCode.OK


class Trainer:
    """One rank's training state: model, optimizer, data, checkpoints, faults and its Replica.

    `applied` is the number of optimizer steps the parameters hold: the only label a checkpoint
    may carry, and the step the loop goes on from after a rejoin.
    """

    def __init__(self, run_dir: Path, config: CheckedConfig, replica: int, rank: int,
                 coordinator: str) -> None:
        cfg = config.cfg
        self.run_dir, self.cfg, self.replica, self.rank = run_dir, cfg, replica, rank
        self.coordinator = coordinator
        self.nranks = cfg.layout.ranks_per_replica()
        self.corpus = load_data(run_dir / rundir.DATA)
        host, port = coordinator.rsplit(":", 1)
        self.token = run_token(run_dir).decode()
        self.rm = layout.build(cfg, host, int(port), replica, rank, self.token)
        self.opt = build_optimizer(self.rm.module, cfg)
        # Before Replica: both build groups of the replica's ranks, in the same order on every rank.
        self.ckpts = RankCheckpoints(run_dir, cfg, self.rm, self.opt)
        self.applied = self.ckpts.resume() if cfg.run.resume else 0
        self.faults = FaultInjector(list(config.faults), replica, rank, self.nranks)
        m, d = cfg.model, cfg.data
        self.evals = eval_batches(self.corpus.val, m.block_size, d.microbatch_size, cfg.run.seed,
                                  d.eval_microbatches)
        self.batches = train_batches(self.corpus.train, m.block_size, d.microbatch_size,
                                     cfg.run.seed, d.sampling)
        # The next step's microbatches, loaded while a commit decision travels (`prefetch`).
        self.prefetched: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.windows_log = _windows_log(LaunchEnv.from_env().windows_log, replica, rank)
        self.timer = StepTimer()
        # The records this rank offered last: a restarted coordinator's store has none of them.
        self.recent: deque[tuple[int, str]] = deque(maxlen=RECORDS_KEPT)
        self.log_every = max(cfg.run.log_every, cfg.run.steps // PROGRESS_LINES, 1)
        self.eta: Eta  # to the step `train` ends before (`train` makes it)
        self.tokens_per_step = d.microbatches * d.microbatch_size * m.block_size
        self.run_start = _run_start(run_dir)
        self.refused: str | None = None  # why a restarted coordinator refused this replica
        # SIGTERM (a scheduler's preemption): leave at the next step boundary (`train`).
        self.preempt = Preemption(die_by_sigterm, cfg.ft.preempt_grace_s)
        self.last_members: list[int] = []  # the members the last committed step had
        self.rep: Replica

    # -- joining ---------------------------------------------------------------------------------
    def join(self) -> bool:
        """Join the run as this replica's rank (a replacement receives a donor's state); False
        (logged) if the coordinator refused it or never answered."""
        ft = self.cfg.ft
        config = replica_config(self.cfg, self.coordinator, self.replica, self.token)
        wait = Deadline(ft.coordinator_wait_s)
        while True:
            try:
                self.rep = Replica(self.rm.module, self.cfg.data.microbatches, mesh=self.rm.mesh,
                                   tied=self.rm.tied, optimizer=self.opt, config=config,
                                   hooks=self.faults.hooks(), strategy=_strategy(self.cfg))
                self.rep.leave_when(self.preempt.requested)
                # A dead coordinator is this loop's to wait for (`rejoin_coordinator`: it offers
                # its records to the restarted one), not Replica.step's.
                self.rep.auto_reconnect = False
                break
            except RunOver:
                raise  # the run finished first: `run` ends this process cleanly
            except CoordinatorGone as e:
                # A replacement whose coordinator died while it was being admitted tries again
                # with the restarted one (bounded like every replica's wait for it).
                if not wait.passed():
                    time.sleep(0.2)
                    continue
                log.error(f"cannot join: {e}")
                return False
            except (CoordinatorLost, TimeoutError) as e:  # refused (another run), or none
                log.error(f"cannot join: {e}")
                return False
        # Read through the current member: after a coordinator restart `reconnect` makes a new
        # one, and the old member's store client is dead.
        self.faults.coordinator_pid = lambda: int(
            keys.try_get(self.rep.member.store, keys.COORD_PID) or 0)
        if self.rep.joined:  # a replacement: it continues from the donor's step, on the trajectory
            self.applied = self.rep.start_step
            log.info(f"joined the running job at step {self.applied} "
                     f"({self.rep.transfer_s:.2f}s state transfer)")
        else:
            log.info(f"joined as replica {self.replica} rank {self.rank} of "
                     f"{self.cfg.layout.replicas} at step {self.applied}")
            if self.rep.exact is not None and self.ckpts.exact_max is not None:
                self.rep.exact.set_maxima(self.ckpts.exact_max)  # resumed: the next exponents
                self.ckpts.exact_max = None  # once: a later rejoin keeps the run's own
        return True

    # -- the loop --------------------------------------------------------------------------------
    def train(self, end: int) -> bool:
        """Steps `applied` .. end-1: compute, reduce and commit (`Replica.step`), then the
        optimizer, evaluation, the checkpoint (at a save point) and the step's record. True when
        it stopped early at a step boundary because this process was preempted (SIGTERM)."""
        cfg, rep = self.cfg, self.rep
        self.eta = Eta(end)
        for step in range(self.applied, end):
            self.timer.start()
            self.faults.step = step
            lr = lr_at(step, cfg)
            set_lr(self.opt, lr)
            self.rm.module.train()
            res = rep.step(step, self.compute, self.prefetch)  # COMPUTE -> REDUCE -> COMMIT
            self.faults.at("optimizer", step, 0)
            grad_norm = rep.clip_grad_norm_(cfg.optim.grad_clip)
            self.opt.step()
            self.applied = step + 1
            rec = step_record(res, lr, grad_norm, self.timer)
            # The proof of the step (`recover verify`): the parameters' digest after it, the
            # same bits on every replica (a multi-rank replica's is an intra-replica sum).
            with rep.guard():
                rec["digest"] = replica_digest(self.rm.module, self.rank, self.nranks,
                                               exact=rep.exact is not None).to_json()
            # Each replica's seconds per microbatch as the step's reduced trailer carried them
            # (what speed-aware quotas follow): the same on every replica, so in every record.
            rec["speeds"] = {str(r): round(v, 6) for r, v in sorted(rep.engine.speeds.items())}
            # Epochs read so far (2.5: two whole epochs, half the third): ids are global.
            rec["epoch"] = round(self.batches.epoch(self.applied * cfg.data.microbatches), 6)
            last = step == end - 1
            if (cfg.data.eval_every and (step + 1) % cfg.data.eval_every == 0) or last:
                with rep.guard():  # a multi-rank evaluation is an intra-replica collective
                    rec["val_loss"] = rep.replica_sum(layout.evaluate(self.rm, self.evals)
                                                      * rep.loss_weight)
            if (cfg.run.ckpt_every and self.applied % cfg.run.ckpt_every == 0) or last:
                # Before the record is offered: the writer's record carries the save's outcome.
                # A failed save is not a failed replica: it is reported and the loop goes on.
                # Every rank: the leader replica's ranks save together; a save may take longer
                # than the stuck-thread watchdog allows between steps, and has its own bounds.
                with rep.guard(), rep.busy():
                    rec.update(self.ckpts.save(self.applied, rep.is_leader,
                                               self.extra(self.applied)))
            self.publish(step, rec)
            self.progress(res, rec, last)
            if rep.leaving and not last:  # asked on some rank of this replica: agreed by all
                self.last_members = list(res.members)
                return True
        return False

    def prefetch(self, step: int, ids: list[int]) -> None:
        """Load the microbatches this rank most likely computes in `step` while the decision
        of the step before travels (idle time: every replica waits for it at once)."""
        self.prefetched = {i: self.batches.batch(i) for i in ids}

    def compute(self, mb_id: int, j: int) -> float:
        """This rank's part of microbatch `mb_id`: gradients += its share of grad(loss)/N."""
        m, seed, step = self.cfg.model, self.cfg.run.seed, self.faults.step
        if self.faults.drops(step, j):  # test-only: a silent loss `recover verify` must catch
            return 0.0
        with self.timer.microbatch(self.faults.slow_factor(step)):
            ready = self.prefetched.pop(mb_id, None)  # a pure function of the id: the same
            x, y = ready if ready is not None else self.batches.batch(mb_id)
            if self.windows_log is not None:
                self.log_windows(mb_id, step)
            seeded = foreign.seeded_forward(m)
            with torch.random.fork_rng(devices=[], enabled=seeded):
                if seeded:  # dropout is the id's own (manual_seed is not free)
                    torch.manual_seed(id_seed(seed, mb_id, stream=Stream.DROPOUT))
                self.faults.at("forward", step, j)
                return self.rm.forward_backward(x, y, lambda: self.faults.at("backward", step, j))

    def log_windows(self, mb_id: int, step: int) -> None:
        """One line per microbatch computed (RECOVER_WINDOWS_LOG): what this rank read."""
        epochs, items = self.batches.items(mb_id)
        assert self.windows_log is not None
        self.windows_log.write(json.dumps({
            "run": str(self.run_dir), "replica": self.replica, "rank": self.rank, "step": step,
            "id": mb_id,
            "epochs": epochs.tolist(), "items": items.tolist()}) + "\n")
        self.windows_log.flush()  # a SIGKILL must not lose what was read

    def publish(self, step: int, rec: dict) -> None:
        """Offer the step's record to the launcher (through the store), from rank 0.

        Every survivor offers the record, on this thread, before its next step; any one that
        lands will do (they agree on everything but their own clocks). A `set` is sent without
        waiting for a reply (a compare-and-set waits for the store's thread, milliseconds a step
        on a loaded host: docs/MEASUREMENTS.md, "TCPStore"), and it reaches the server before
        this replica's next request on the same client: before it counts its next step, so
        before the sink can have read step + 2 and deleted this key. Not the leader alone, from a
        background thread: a leader killed before its offer left, with every other replica
        killed in the next step, would lose a line. At a save point the writer offers its record
        after the save, with the outcome; the others' records say `ckpt_pending` and the sink
        waits for the writer's (`MetricsSink`).
        """
        if self.rank == 0:
            self.recent.append((step, seal_record(self.token, step, rec)))
            store, key = self.rep.member.store, keys.record_key(step)
            if rec.get("ckpt_pending"):
                # A save point's record from a replica that did not write: only added where no
                # record is (the writer's, with the save's outcome, must not be overwritten);
                # one round trip per checkpoint interval.
                store.compare_set(key, "", self.recent[-1][1])
            else:
                store.set(key, self.recent[-1][1])

    def progress(self, res: StepResult, rec: dict, last: bool) -> None:
        """The step's progress line in this rank's log, as the launcher shows it piped (step
        line, elapsed since the run's start, ETA): every `log_every` steps (fewer for long runs:
        `PROGRESS_LINES`), every step that recovered or validated, and the last."""
        recovered = res.recovered or res.attempts > 1
        if last or res.step % self.log_every == 0 or recovered or "val_loss" in rec:
            elapsed = time.time() - self.run_start
            shown = {**rec, "time_s": elapsed,
                     "tokens_per_s": self.tokens_per_step / max(rec["step_time_s"], 1e-9)}
            log.info(step_line(shown, self.eta.steps, self.eta(res.step, elapsed)))

    def extra(self, at: int) -> dict:
        """A checkpoint's metadata, labelled `at`; refuses a label the state does not hold."""
        # The label is what the state holds: AdamW counts the steps it applied (none: no state);
        # a save after an error must never relabel the state (a resume would repeat a step).
        held = {int(st["step"]) for st in self.opt.state.values() if "step" in st} or {0}
        if held != {at} or at != self.applied:
            raise RuntimeError(f"refusing to label a checkpoint step {at}: the optimizer state "
                               f"holds {sorted(held)} applied steps (applied={self.applied})")
        extra: dict = {"next_microbatch_id": at * self.cfg.data.microbatches,
                       "trajectory": self.cfg.trajectory_key()}
        if self.rep.exact is not None:
            extra[EXACT_MAX] = self.rep.exact.max_seen
        return extra

    # -- the ways a run stops --------------------------------------------------------------------
    def stop_below_min(self, e: BelowMinReplicas) -> int:
        """Too few replicas are left: checkpoint the committed steps (the leader) and stop."""
        log.error(f"stopping: {e}")
        # committed steps only: the failed step was never applied
        rep = self.rep
        out = self.ckpts.save_on_exit(self.applied, rep.is_leader, self.extra(self.applied))
        if rep.is_leader:
            what = (f"checkpoint at step {self.applied}" if "ckpt" in out else
                    f"no checkpoint at step {self.applied} ({out.get('ckpt_error')})")
            rep.member.store.set(keys.RUN_STOPPED, f"{e}; {what}")
        rep.leave()
        return ExitCode.BELOW_MIN

    def stop_preempted(self) -> int:
        """Preempted (SIGTERM): a planned leave at this step boundary, after a committed step;
        the others take this replica's ids from the next step on, with no fault and nothing
        computed twice. When the whole job goes (the launcher says so in the store), the leader
        of the last committed step checkpoints it first, so `--resume` loses nothing."""
        rep = self.rep
        whole = False
        with contextlib.suppress(Exception):  # no store: not the launcher's preemption
            whole = keys.try_get(rep.member.store, keys.JOB_PREEMPTED) is not None
        if whole:
            leader = self.rank == 0 and min(self.last_members) == self.replica
            with rep.busy():  # a save may outlast the stuck-thread watchdog's bound
                out = self.ckpts.save_on_exit(self.applied, leader, self.extra(self.applied))
            if "ckpt" in out:
                log.info(f"preempted: saved a checkpoint at step {self.applied}")
        log.warning(f"preempted (SIGTERM): leaving at the step boundary after step "
                    f"{self.applied - 1}" + ("" if whole else "; the others take over"))
        rep.leave(PREEMPTED)
        return ExitCode.OK

    def rejoin_coordinator(self, e: Exception, end: int) -> bool:
        """The coordinator is unreachable: keep this state and join a restarted one (within
        --coordinator-wait-s). True if the loop goes on (from `applied`)."""
        wait_s, self.refused = self.cfg.ft.coordinator_wait_s, None
        if self.applied >= end or wait_s <= 0:
            return False
        log.warning(f"the coordinator is unreachable ({first_line(e)}); keeping the state of "
                    f"step {self.applied} and waiting up to {wait_s:g}s for it to restart")
        try:
            if not self.rep.reconnect(self.applied, wait_s):
                return False
        except CoordinatorLost as refused:
            self.refused = str(refused)
            return False
        if self.rep.joined:  # healed: its state is now that of a replica at start_step
            log.info(f"the restarted coordinator resumed the run at step {self.rep.start_step}: "
                     f"this replica was at {self.applied} and received that state "
                     f"({self.rep.transfer_s:.2f}s transfer)")
            self.applied = self.rep.start_step
        else:
            log.info(f"the restarted coordinator resumed the run at step {self.applied}")
        if self.rank == 0:  # records the new store never saw (the launcher needs them)
            for s, r in self.recent:
                if s < self.applied:
                    self.rep.member.store.compare_set(keys.record_key(s), "", r)
        return True

    def stop_coordinator_lost(self, e: Exception, end: int) -> int:
        """No coordinator to go on with: the last leader checkpoints, and every rank stops."""
        why = self.refused or first_line(e)
        wait_s = self.cfg.ft.coordinator_wait_s
        if self.applied < end and wait_s > 0:  # it waited (rejoin_coordinator) in vain
            why = f"no coordinator came back within {wait_s:g}s ({why})"
        log.error(f"stopping: the coordinator is unreachable ({why})")
        # Not a state that a heal's failed transfer left partly overwritten.
        out = self.ckpts.save_on_exit(self.applied, self.rep.is_leader and self.rep.holds_state,
                                      self.extra(self.applied))
        if "ckpt" in out:
            log.info(f"saved a checkpoint at step {self.applied}")  # the last leader
        # Every step applied: the coordinator leaving now is the end of the run.
        return ExitCode.OK if self.applied == end else ExitCode.COORDINATOR_LOST

    def finish(self) -> None:
        """Every step trained: dump the final parameters (if asked) and leave cleanly."""
        if self.cfg.run.dump_final:
            _dump_final(self.run_dir, self.rm.module, self.replica, self.rank, self.nranks)
        log.info(f"done: {self.applied} steps applied")
        self.rep.leave()



def _run_start(run_dir: Path) -> float:
    """When the run started (the launcher's `run_start`: elapsed times in every log count from
    it); this process's start where the file is missing or unreadable."""
    try:
        return float((run_dir / rundir.RUN_START).read_text())
    except (OSError, ValueError):
        return time.time()


def _windows_log(folder: str | None, replica: int, rank: int) -> TextIO | None:
    """This process's own file in the RECOVER_WINDOWS_LOG folder (None: not asked for)."""
    if folder is None:
        return None
    path = Path(folder) / f"windows.{replica}.{rank}.{os.getpid()}.jsonl"
    return open(path, "a", encoding="utf-8")  # open for the process's life


def _strategy(cfg: RunConfig) -> StepStrategy | None:
    """`recover`: in-step recovery (the engine's default); `shrink-batch`: the torchft baseline."""
    if cfg.ft.policy == "shrink-batch":
        from recover.recovery.shrink import ShrinkBatch

        return ShrinkBatch(range(cfg.layout.replicas))
    return None


def _dump_final(run_dir: Path, module: torch.nn.Module, replica: int, rank: int,
                nranks: int) -> None:
    """Each rank's final local parameters, to compare replicas bitwise (tests, debugging)."""
    from recover.layouts.sharded import local_tensor

    (run_dir / rundir.FINAL).mkdir(exist_ok=True)
    name = rundir.final_params(replica, rank, nranks)
    state = {k: local_tensor(v.detach()).clone() for k, v in module.state_dict().items()}
    torch.save(state, run_dir / rundir.FINAL / name)
