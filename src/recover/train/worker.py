"""One replica's training process: the reference trainer's loop, top to bottom.

Invariant: the parameters after step t depend only on the config and on the N microbatch ids of
steps 0..t, never on how many replicas computed them or which ones died: each microbatch's data
and dropout come from its id, the gradient is the sum of per-microbatch gradients / N, and the
optimizer runs only after the step's commit decision. Launched by `recover train` (one process per
replica) or by `torchrun` (env `RECOVER_COORDINATOR=host:port`, `RECOVER_REPLICA=i`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.distributed import DistError

from recover.collectives import CoordinatorLost, FaultTolerantComm, GlooInterfaceError, Member
from recover.config import RunConfig
from recover.faults import FaultInjector, validate_faults
from recover.parallel import flat_grad_buffer
from recover.recovery import BelowMinReplicas, StepEngine
from recover.train.data import eval_batches, load_data, microbatch
from recover.train.model import build_model
from recover.train.optim import build_optimizer, lr_at, set_lr
from recover.workload import id_seed

EXIT_BELOW_MIN = 4
EXIT_COORDINATOR_LOST = 5


def log(replica: int, msg: str) -> None:
    print(f"[replica {replica}] {msg}", file=sys.stderr, flush=True)


def run(run_dir: Path, replica: int, host: str, port: int) -> int:
    torch.set_num_threads(1)  # measured: 2 threads x 4 processes on 2 cores is 10x slower
    cfg = RunConfig.load(run_dir / "config.json")
    corpus = load_data(run_dir / "data")
    m = cfg.model
    model = build_model(m, cfg.seed)
    opt = build_optimizer(model, cfg)
    start = 0
    ckpt_root = run_dir / "ckpt"
    if cfg.resume:
        from recover.train.checkpoint import latest_checkpoint, load_checkpoint

        path = latest_checkpoint(ckpt_root)
        start = int(load_checkpoint(path, model, opt)["step"])
        log(replica, f"resumed from {path.name} at step {start}")
    # After the checkpoint load (which resets .grad): p.grad become views of `grad`, so backward
    # accumulates straight into the buffer the cross-replica reduction reads.
    grad = flat_grad_buffer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    faults = FaultInjector(validate_faults(cfg.faults, cfg.replicas, cfg.steps), replica)
    member = Member(host, port, replica, heartbeat_s=cfg.heartbeat_s,
                    timeout_s=cfg.join_timeout_s)
    member.join()
    comm = FaultTolerantComm(member, timeout_s=cfg.reduce_timeout_s)
    engine = _engine_class(cfg.policy)(member, comm, grad, cfg.microbatches,
                                       min_replicas=cfg.min_replicas,
                                       timeout_s=cfg.reduce_timeout_s, hook=faults.at,
                                       speed_aware=cfg.speed_aware)
    evals = eval_batches(corpus.val, m.block_size, cfg.microbatch_size, cfg.seed,
                         cfg.eval_microbatches)
    step = start
    applied = start  # optimizer steps applied: the only label a checkpoint of this state may get
    saved = -1  # the step the leader last saved (the final checkpoint is never written twice)
    busy = [0.0, 0]  # this step's compute seconds and microbatches (all attempts)

    def compute(mb_id: int, j: int) -> float:
        """Forward + backward of one microbatch, accumulating grad(loss)/N into `grad`."""
        t0 = time.perf_counter()
        x, y = microbatch(corpus.train, m.block_size, cfg.microbatch_size, cfg.seed, mb_id)
        with torch.random.fork_rng(devices=[], enabled=m.dropout > 0):
            torch.manual_seed(id_seed(cfg.seed, mb_id, stream=1))  # dropout is the id's own
            faults.at("forward", step, j)
            _, loss = model(x, y)
            faults.at("backward", step, j)
            (loss / cfg.microbatches).backward()  # constant N, never the live replica count
        slow = faults.slow_factor(step)
        if slow > 1:
            time.sleep((slow - 1) * (time.perf_counter() - t0))
        busy[0] += time.perf_counter() - t0
        busy[1] += 1
        return float(loss.detach())

    def save(at_step: int) -> None:
        # Imported here: DCP costs ~1.5 s of CPU at startup, and only the leader ever saves.
        from recover.train.checkpoint import save_checkpoint

        nonlocal saved
        # The label is what the state holds: AdamW counts the steps it applied (none: no state).
        held = {int(s["step"]) for s in opt.state.values() if "step" in s} or {0}
        if held != {at_step} or at_step != applied:
            raise RuntimeError(f"refusing to label a checkpoint step {at_step}: the optimizer "
                               f"state holds {sorted(held)} applied steps (applied={applied})")
        save_checkpoint(ckpt_root, at_step, model, opt,
                        {"next_microbatch_id": at_step * cfg.microbatches,
                         "trajectory": cfg.trajectory_key()})
        saved = at_step

    try:
        end = cfg.stop_at or cfg.steps
        for step in range(start, end):
            t0 = time.time()
            lr = lr_at(step, cfg)
            set_lr(opt, lr)
            model.train()
            grad.zero_()
            busy[:] = [0.0, 0]
            res = engine.run(step, compute)  # COMPUTE -> REDUCE -> agreed COMMIT
            faults.at("optimizer", step, 0)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            opt.step()
            applied = step + 1
            rec = {"step": step, "loss": res.loss, "lr": lr, "grad_norm": grad_norm,
                   "microbatches": res.microbatches, "live_replicas": len(res.members),
                   "quotas": {str(k): v for k, v in res.quotas.items()},
                   "generation": res.generation, "recovered": res.recovered,
                   "recovery_s": round(res.recovery_s, 4), "attempts": res.attempts,
                   "step_time_s": round(time.time() - t0, 4), "t_commit": time.time(),
                   "mb_time_s": round(busy[0] / max(1, busy[1]), 5)}
            last = step == end - 1
            if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or last:
                rec["val_loss"] = evaluate(model, evals)
            # Every survivor offers the record; the first one lands (all agree on the numbers).
            member.store.compare_set(f"rec/{step}", "", json.dumps(rec))
            leader = min(member.members()) == replica
            if leader and ((cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or last):
                save(applied)
                member.store.set(f"ckpt/{applied}", "saved")
    except BelowMinReplicas as e:
        log(replica, f"stopping: {e}")
        if min(member.members()) == replica:
            save(applied)  # committed steps only: `step` has not been applied
            member.store.set("run/stopped", f"{e}; checkpoint at step {applied}")
        member.leave()
        return EXIT_BELOW_MIN
    except GlooInterfaceError as e:  # a configuration error, not a fault: one line, no traceback
        log(replica, f"stopping: {e}")
        return 2
    except (CoordinatorLost, DistError) as e:  # the store went away with the coordinator
        log(replica, f"stopping: the coordinator is unreachable ({str(e).splitlines()[0]})")
        leader = min(member.members()) == replica
        if leader and saved != applied:  # the last known leader keeps the committed state
            log(replica, f"saving a checkpoint at step {applied}")
            save(applied)
        if applied == (cfg.stop_at or cfg.steps):
            # Every step was applied: the coordinator leaving now is the end of the run.
            return 0
        return EXIT_COORDINATOR_LOST
    if cfg.dump_final:
        (run_dir / "final").mkdir(exist_ok=True)
        torch.save(model.state_dict(), run_dir / "final" / f"replica{replica}.pt")
    member.leave()
    return 0


def _engine_class(policy: str) -> type[StepEngine]:
    """`recover`: in-step recovery; `shrink-batch`: the torchft baseline (batch shrinks)."""
    if policy == "shrink-batch":
        from recover.baselines.shrink import ShrinkEngine

        return ShrinkEngine
    return StepEngine


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list) -> float:
    model.eval()
    losses = [float(model(x, y)[1]) for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recover.train.worker")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--replica", type=int, default=int(os.environ.get("RECOVER_REPLICA", -1)))
    ap.add_argument("--coordinator", default=os.environ.get("RECOVER_COORDINATOR"))
    ap.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)),
                    help="rank within a multi-rank replica (torchrun: RANK, one torchrun per "
                         "replica)")
    ap.add_argument("--gloo-ifname", default=None, metavar="IF",
                    help="network interface for cross-replica traffic (default: the one that "
                         "reaches the coordinator; same as GLOO_SOCKET_IFNAME)")
    args = ap.parse_args(argv)
    if args.gloo_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.gloo_ifname
    if args.replica < 0 or not args.coordinator:
        print("recover worker: need --replica/RECOVER_REPLICA and --coordinator/"
              "RECOVER_COORDINATOR", file=sys.stderr)
        return 2
    host, port = args.coordinator.rsplit(":", 1)
    if RunConfig.load(Path(args.run_dir) / "config.json").layout != "plain":
        from recover.train.multirank import run as run_ranks  # hsdp, tp, pp, tp,pp

        return run_ranks(Path(args.run_dir), args.replica, args.rank, host, int(port))
    return run(Path(args.run_dir), args.replica, host, int(port))


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    sys.stdout.flush()
    # Skip interpreter teardown: destroying a gloo group that a dead peer left mid-operation can
    # abort the process ("terminate called without an active exception").
    os._exit(code)
