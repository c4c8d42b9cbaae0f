"""One rank of a multi-rank replica (layouts hsdp, tp, pp, tp,pp): the reference trainer's loop.

Invariant: as for a plain replica (`recover.train.worker`), the parameters after step t depend
only on the config and the N microbatch ids of steps 0..t: every rank of a replica computes the
ids its replica owns, in the chain's order, with its share of each id's work (its rows under hsdp,
all rows under tp, its stage under pp), and the cross-replica reduction runs per position
(`recover.parallel.Replica`). The replica's ranks form their own default process group (prefix
`replica{r}/pg` on the coordinator's store), so FSDP2/DTensor/pipelining never reach across
replicas. If a rank dies, its replica is lost: the coordinator drops it from the next generation
and the other ranks are fenced (exit code 3); the surviving replicas recover the step.
Launched by `recover train --layout ...` (replicas x ranks processes) or by one `torchrun` per
replica (`RANK` = rank within the replica).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import DistError

from recover.collectives import CoordinatorLost
from recover.config import RunConfig
from recover.faults import FaultInjector, validate_faults
from recover.parallel import Replica, init_replica_group, replica_mesh
from recover.parallel.grads import local_tensor
from recover.parallel.hsdp import local_rows, shard_model
from recover.parallel.pp import Pipeline
from recover.parallel.tp import parallelize
from recover.recovery import BelowMinReplicas
from recover.train.data import eval_batches, load_data, microbatch
from recover.train.model import build_model
from recover.train.optim import build_optimizer, lr_at, set_lr
from recover.workload import id_seed

EXIT_BELOW_MIN = 4
EXIT_COORDINATOR_LOST = 5


def run(run_dir: Path, replica: int, rank: int, host: str, port: int) -> int:
    torch.set_num_threads(1)
    cfg = RunConfig.load(run_dir / "config.json")
    nranks = cfg.layout.ranks_per_replica()

    def log(msg: str) -> None:
        print(f"[replica {replica} rank {rank}] {msg}", file=sys.stderr, flush=True)

    if not 0 <= rank < nranks:
        log(f"rank {rank} is not in [0, {nranks}) for --layout {cfg.layout.name}")
        return 2
    corpus = load_data(run_dir / "data")
    m, n = cfg.model, cfg.data.microbatches
    init_replica_group(host, port, replica, rank, nranks, cfg.ft.reduce_timeout_s)
    mesh = replica_mesh(cfg.layout.name, cfg.layout.shards, cfg.layout.tp, cfg.layout.stages)
    model = build_model(m, cfg.run.seed)
    pipe: Pipeline | None = None
    tied: list[nn.Parameter] = []
    if "tp" in cfg.layout.name.split(","):
        parallelize(model, mesh)
    if cfg.layout.name == "hsdp":
        shard_model(model, mesh)
    module: nn.Module = model
    if "pp" in cfg.layout.name.split(","):
        pipe = Pipeline(model, mesh, n)
        module, tied = pipe.module, pipe.module.tied()
    opt = build_optimizer(module, cfg)
    faults = FaultInjector(validate_faults(cfg.ft.faults, cfg.layout.replicas, cfg.run.steps,
                                           nranks), replica,
                           rank, nranks)
    rep = Replica(module, n, mesh=mesh, tied=tied, coordinator=f"{host}:{port}", replica=replica,
                  min_replicas=cfg.ft.min_replicas, timeout_s=cfg.ft.reduce_timeout_s,
                  join_timeout_s=cfg.ft.join_timeout_s, heartbeat_s=cfg.ft.heartbeat_s,
                  hook=faults.at, speed_aware=cfg.ft.speed_aware)
    evals = eval_batches(corpus.val, m.block_size, cfg.data.microbatch_size, cfg.run.seed,
                         cfg.data.eval_microbatches)
    step = 0
    busy = [0.0, 0]

    def compute(mb_id: int, j: int) -> float:
        """This rank's part of microbatch `mb_id`: gradients += its share of grad(loss)/N."""
        t0 = time.perf_counter()
        x, y = microbatch(corpus.train, m.block_size, cfg.data.microbatch_size, cfg.run.seed,
                          mb_id)
        with torch.random.fork_rng(devices=[], enabled=m.dropout > 0):
            torch.manual_seed(id_seed(cfg.run.seed, mb_id, stream=1))
            faults.at("forward", step, j)
            if pipe is not None:
                pipe.module.on_backward = lambda: faults.at("backward", step, j)
                loss = pipe.forward_backward(x, y)
            else:
                _, out = model(local_rows(x, mesh), local_rows(y, mesh))
                faults.at("backward", step, j)
                (out / n).backward()  # constant N, never the live replica count
                loss = float(out.detach())
        slow = faults.slow_factor(step)
        if slow > 1:
            time.sleep((slow - 1) * (time.perf_counter() - t0))
        busy[0] += time.perf_counter() - t0
        busy[1] += 1
        return loss

    @torch.no_grad()
    def evaluate() -> float:
        module.eval()
        with rep.guard():
            if pipe is not None:
                local = sum(pipe.evaluate(x, y) for x, y in evals) / len(evals)
            else:
                local = sum(float(model(x, y)[1]) for x, y in evals) / len(evals)
            t = torch.tensor([local * rep.loss_weight], dtype=torch.float64)
            dist.all_reduce(t)
        module.train()
        return float(t)

    try:
        end = cfg.run.steps
        for step in range(end):
            t0 = time.time()
            lr = lr_at(step, cfg)
            set_lr(opt, lr)
            module.train()
            busy[:] = [0.0, 0]
            res = rep.step(step, compute)  # COMPUTE -> REDUCE (per position) -> agreed COMMIT
            faults.at("optimizer", step, 0)
            grad_norm = rep.clip_grad_norm_(cfg.optim.grad_clip)
            opt.step()
            rec = {"step": step, "loss": res.loss, "lr": lr, "grad_norm": grad_norm,
                   "microbatches": res.microbatches, "live_replicas": len(res.members),
                   "quotas": {str(k): v for k, v in res.quotas.items()},
                   "generation": res.generation, "recovered": res.recovered,
                   "recovery_s": round(res.recovery_s, 4), "attempts": res.attempts,
                   "step_time_s": round(time.time() - t0, 4), "t_commit": time.time(),
                   "mb_time_s": round(busy[0] / max(1, busy[1]), 5)}
            if (cfg.data.eval_every and (step + 1) % cfg.data.eval_every == 0) or step == end - 1:
                rec["val_loss"] = evaluate()
            if rank == 0:  # every replica's rank 0 offers the record; the first one lands
                rep.member.store.compare_set(f"rec/{step}", "", json.dumps(rec))
    except BelowMinReplicas as e:
        log(f"stopping: {e}")
        if rep.is_leader:
            rep.member.store.set("run/stopped", f"{e}; no checkpoint (layout {cfg.layout.name} "
                                 "has no checkpoints yet)")
        rep.leave()
        return EXIT_BELOW_MIN
    except (CoordinatorLost, DistError) as e:
        log(f"stopping: the coordinator is unreachable ({str(e).splitlines()[0]})")
        return EXIT_COORDINATOR_LOST
    if cfg.run.dump_final:
        (run_dir / "final").mkdir(exist_ok=True)
        local = {k: local_tensor(v.detach()).clone() for k, v in module.state_dict().items()}
        torch.save(local, run_dir / "final" / f"replica{replica}.rank{rank}.pt")
    rep.leave()
    return 0
