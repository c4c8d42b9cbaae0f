"""One rank of one replica: the reference trainer's loop, top to bottom, for every layout.

Invariant: the parameters after step t depend only on the config and on the N microbatch ids of
steps 0..t, never on how many replicas computed them or which ones died: each microbatch's data
and dropout come from its id, the gradient is the sum of per-microbatch gradients / N, and the
optimizer runs only after the step's commit decision (`recover.Replica.step`). A checkpoint is
labelled with the number of optimizer steps it holds, whatever path saves it.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from pathlib import Path

import torch
from torch.distributed import DistError

from recover.app.config import RunConfig, fingerprint
from recover.app.faults import FaultInjector, validate_faults
from recover.app.runtoken import run_token
from recover.app.train import layout
from recover.app.train.ckpt_rank import RankCheckpoints
from recover.app.train.data import eval_batches, load_data, microbatch
from recover.app.train.metrics import StepTimer, step_record
from recover.app.train.optim import build_optimizer, lr_at, set_lr
from recover.collectives import CoordinatorGone, CoordinatorLost, GlooInterfaceError, keys
from recover.parallel import Replica
from recover.recovery import BelowMinReplicas, StepStrategy
from recover.workload import id_seed

EXIT_OK, EXIT_USAGE, EXIT_BELOW_MIN, EXIT_COORDINATOR_LOST = 0, 2, 4, 5
RECORDS_KEPT = 256  # offered again to a restarted coordinator (the launcher may not have read them)


def run(run_dir: Path, replica: int, rank: int, host: str, port: int) -> int:
    torch.set_num_threads(1)  # measured: 2 threads x 4 processes on 2 cores is 10x slower
    cfg = RunConfig.load(run_dir / "config.json")
    nranks = cfg.layout.ranks_per_replica()

    def log(msg: str) -> None:
        who = f"replica {replica}" + (f" rank {rank}" if nranks > 1 else "")
        print(f"[{who}] {msg}", file=sys.stderr, flush=True)

    if not 0 <= rank < nranks:
        log(f"rank {rank} is not in [0, {nranks}) for --layout {cfg.layout.name}")
        return EXIT_USAGE
    corpus = load_data(run_dir / "data")
    m, ft, seed = cfg.model, cfg.ft, cfg.run.seed
    n, b = cfg.data.microbatches, cfg.data.microbatch_size
    rm = layout.build(cfg, host, port, replica, rank)
    opt = build_optimizer(rm.module, cfg)
    # Before Replica: both build groups of the replica's ranks, in the same order on every rank.
    ckpts = RankCheckpoints(run_dir, cfg, rm, opt, log)
    applied = 0  # optimizer steps in the parameters: the only label a checkpoint may carry
    if cfg.run.resume:
        applied = ckpts.resume()
    faults = FaultInjector(validate_faults(ft.faults, cfg.layout.replicas, cfg.run.steps, nranks),
                           replica, rank, nranks)
    rep: Replica | None = None
    wait_until = time.monotonic() + ft.coordinator_wait_s
    while rep is None:
        try:
            rep = Replica(rm.module, n, mesh=rm.mesh, tied=rm.tied, coordinator=f"{host}:{port}",
                          replica=replica, min_replicas=ft.min_replicas,
                          timeout_s=ft.reduce_timeout_s, join_timeout_s=ft.join_timeout_s,
                          heartbeat_s=ft.heartbeat_s, hook=faults.at, speed_aware=ft.speed_aware,
                          strategy=_strategy(cfg), exact=cfg.compute.exact,
                          backend=cfg.compute.backend, optimizer=opt,
                          reduce_dtype=layout.DTYPES.get(cfg.compute.reduce_dtype),
                          token=run_token(run_dir).decode(), fingerprint=fingerprint(cfg),
                          scheduled_joins={f.replica: f.step for f in faults.all
                                           if f.kind == "restart"},
                          link_down=lambda: faults.partitioned(step),
                          coordinator_wait_s=ft.coordinator_wait_s)
        except CoordinatorGone as e:
            # A replacement whose coordinator died while it was being admitted tries again
            # with the restarted one (bounded like every replica's wait for it).
            if time.monotonic() < wait_until:
                time.sleep(0.2)
                continue
            log(f"cannot join: {e}")
            return EXIT_USAGE
        except (CoordinatorLost, TimeoutError) as e:  # refused (another run), or no coordinator
            log(f"cannot join: {e}")
            return EXIT_USAGE
    faults.coordinator_pid = lambda: int(keys.try_get(rep.member.store, keys.COORD_PID) or 0)
    if rep.joined:  # a replacement: it continues from the donor's step, on the trajectory
        applied = rep.start_step
        log(f"joined the running job at step {applied} ({rep.transfer_s:.2f}s state transfer)")
    evals = eval_batches(corpus.val, m.block_size, b, seed, cfg.data.eval_microbatches)
    timer = StepTimer()
    step = applied

    def compute(mb_id: int, j: int) -> float:
        """This rank's part of microbatch `mb_id`: gradients += its share of grad(loss)/N."""
        with timer.microbatch(faults.slow_factor(step)):
            x, y = microbatch(corpus.train, m.block_size, b, seed, mb_id)
            with torch.random.fork_rng(devices=[], enabled=m.dropout > 0):
                if m.dropout > 0:  # dropout is the id's own (manual_seed costs ~0.25 ms a call)
                    torch.manual_seed(id_seed(seed, mb_id, stream=1))
                faults.at("forward", step, j)
                return rm.forward_backward(x, y, lambda: faults.at("backward", step, j))

    def extra(at: int) -> dict:
        # The label is what the state holds: AdamW counts the steps it applied (none: no state);
        # a save after an error must never relabel the state (a resume would repeat a step).
        held = {int(st["step"]) for st in opt.state.values() if "step" in st} or {0}
        if held != {at} or at != applied:
            raise RuntimeError(f"refusing to label a checkpoint step {at}: the optimizer state "
                               f"holds {sorted(held)} applied steps (applied={applied})")
        return {"next_microbatch_id": at * n, "trajectory": cfg.trajectory_key()}

    end = cfg.run.stop_at or cfg.run.steps
    # The records this rank offered last: a restarted coordinator's store has none of them.
    recent: deque[tuple[int, str]] = deque(maxlen=RECORDS_KEPT)
    while True:  # once, unless the coordinator dies and a restarted one takes over
        try:
            for step in range(applied, end):
                timer.start()
                lr = lr_at(step, cfg)
                set_lr(opt, lr)
                rm.module.train()
                res = rep.step(step, compute)  # COMPUTE -> REDUCE -> agreed COMMIT
                faults.at("optimizer", step, 0)
                grad_norm = rep.clip_grad_norm_(cfg.optim.grad_clip)
                opt.step()
                applied = step + 1
                rec = step_record(res, lr, grad_norm, timer)
                last = step == end - 1
                if (cfg.data.eval_every and (step + 1) % cfg.data.eval_every == 0) or last:
                    with rep.guard():  # a multi-rank evaluation is an intra-replica collective
                        rec["val_loss"] = rep.replica_sum(layout.evaluate(rm, evals)
                                                          * rep.loss_weight)
                # Every survivor offers the record, on this thread, before its next step; any one
                # that lands will do (they agree on everything but their own clocks). A `set` is
                # sent without waiting for a reply (a compare-and-set waited ~2 ms a step for the
                # store's thread on a loaded host), and it reaches the server before this
                # replica's next request on the same client: before it counts its next step, so
                # before the sink can have read step + 2 and deleted this key. Only the leader,
                # from a background thread, was tried: a leader killed before its offer left, with
                # every other replica killed in the next step, lost a line (CHANGELOG.md, 0.3.1).
                if rank == 0:
                    recent.append((step, json.dumps(rec)))
                    rep.member.store.set(keys.record_key(step), recent[-1][1])
                if (cfg.run.ckpt_every and applied % cfg.run.ckpt_every == 0) or last:
                    with rep.guard():  # every rank: the leader replica's ranks save together
                        ckpts.save(applied, rep.is_leader, extra(applied))
            break
        except BelowMinReplicas as e:
            log(f"stopping: {e}")
            # committed steps only: the failed step was never applied
            saved = ckpts.save_on_exit(applied, rep.is_leader, extra(applied))
            if rep.is_leader:
                what = "checkpoint" if saved else "no checkpoint"
                rep.member.store.set(keys.RUN_STOPPED, f"{e}; {what} at step {applied}")
            rep.leave()
            return EXIT_BELOW_MIN
        except GlooInterfaceError as e:  # a configuration error, not a fault: one line
            log(f"stopping: {e}")
            return EXIT_USAGE  # without leave(): the coordinator records the replica as lost
        except (CoordinatorLost, DistError) as e:  # the store went away with the coordinator
            why = str(e).splitlines()[0]
            if applied < end and ft.coordinator_wait_s > 0:
                log(f"the coordinator is unreachable ({why}); keeping the state of step "
                    f"{applied} and waiting up to {ft.coordinator_wait_s:g}s for it to restart")
                try:
                    back = rep.reconnect(applied, ft.coordinator_wait_s)
                except CoordinatorLost as refused:
                    back, why = False, str(refused)
                if back:
                    if rep.joined:  # healed: its state is now that of a replica at start_step
                        log(f"the restarted coordinator resumed the run at step "
                            f"{rep.start_step}: this replica was at {applied} and received "
                            f"that state ({rep.transfer_s:.2f}s transfer)")
                        applied = rep.start_step
                    else:
                        log(f"the restarted coordinator resumed the run at step {applied}")
                    if rank == 0:  # records the new store never saw (the launcher needs them)
                        for s, r in recent:
                            if s < applied:
                                rep.member.store.compare_set(keys.record_key(s), "", r)
                    continue
                why = f"no coordinator came back within {ft.coordinator_wait_s:g}s ({why})"
            log(f"stopping: the coordinator is unreachable ({why})")
            if ckpts.save_on_exit(applied, rep.is_leader, extra(applied)):  # the last leader
                log(f"saved a checkpoint at step {applied}")
            # Every step applied: the coordinator leaving now is the end of the run.
            return EXIT_OK if applied == end else EXIT_COORDINATOR_LOST
    if cfg.run.dump_final:
        _dump_final(run_dir, rm.module, replica, rank, nranks)
    rep.leave()
    return EXIT_OK


def _strategy(cfg: RunConfig) -> StepStrategy | None:
    """`recover`: in-step recovery (the engine's default); `shrink-batch`: the torchft baseline."""
    if cfg.ft.policy == "shrink-batch":
        from recover.recovery.shrink import ShrinkBatch

        return ShrinkBatch(range(cfg.layout.replicas))
    return None


def _dump_final(run_dir: Path, module: torch.nn.Module, replica: int, rank: int,
                nranks: int) -> None:
    """Each rank's final local parameters, to compare replicas bitwise (tests, debugging)."""
    from recover.parallel.grads import local_tensor

    (run_dir / "final").mkdir(exist_ok=True)
    name = f"replica{replica}.pt" if nranks == 1 else f"replica{replica}.rank{rank}.pt"
    state = {k: local_tensor(v.detach()).clone() for k, v in module.state_dict().items()}
    torch.save(state, run_dir / "final" / name)
