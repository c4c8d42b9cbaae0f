"""The torchtitan test job's launcher: every rank of both runs, forked from one interpreter.

argv: OUT TOKENIZER_DIR TEXT_FILE STEPS N KILL_STEP REF_PORT_FILE KILL_PORT_FILE RESUME_PORT_FILE
RANKS DEVICE
(DEVICE "cpu": gloo inside a replica; "cuda": NCCL, every rank on cuda:0). It imports torch
and torchtitan once (seconds on a loaded 2-core host: one interpreter per rank made the test take
minutes), then forks each replica's ranks, as `torchrun` would start them: the failure-free
reference (one replica, at the coordinator in REF_PORT_FILE) and the run with the fault (two
replicas, KILL_PORT_FILE), concurrently. Replica 1's rank 0 SIGKILLs itself in step KILL_STEP's
reduce; the launcher then kills its other rank and starts the replica again under a new
RECOVER_INCARNATION and a fresh process group, as `worker_loop` (recover.app.cluster) restarts a
replica's torchrun; every replica's plan waits (bounded) for the replacement at the next step
boundary (`Hooks.scheduled_joins`), so the rejoin happens before the end on a loaded machine too.
The last incarnation's rank 0 of each replica writes OUT/{run}/replica{R}.json (each step's loss,
microbatch count, live replicas; the start step) and OUT/{run}/params{R}.pt; torchtitan's
checkpointer saves step STEPS-1 and the last step into OUT/kill/checkpoint/step-N. Then a third
run resumes: one replica (at the coordinator in RESUME_PORT_FILE) whose checkpoint folder holds
only the kill run's step-(STEPS-1) save loads it and trains the last step.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the tokenizer runs before the fork

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

from recover.integrations.torchtitan import (  # noqa: E402
    IdDataLoader,
    RecoverTrainer,
    recover_config,
)
from recover.settings import Hooks  # noqa: E402

SEQ_LEN, ROWS = 32, 4  # tokens per row; rows per microbatch (over the replica's ranks)
TIMEOUT_S = 150  # the whole job, generous: the suite runs it beside others on 2 cores


@dataclass(frozen=True)
class Job:
    out: Path
    tokenizer: str
    text: str
    steps: int
    n: int
    kill_step: int
    ranks: int  # per replica
    device: str


def hooks(job: Job, run: str, replica: int, incarnation: int, rank: int) -> Hooks:
    """The fault: replica 1's first incarnation's rank 0 dies once it holds a microbatch in
    step `kill_step`'s reduce; every plan of that run waits for the replacement at the next
    boundary (bounded by the reduce timeout: without it, the end could come first)."""
    if run != "kill":
        return Hooks()
    joins = {1: job.kill_step + 1}
    if (replica, incarnation, rank) != (1, 0, 0):
        return Hooks(scheduled_joins=joins)

    def at(phase: str, step: int, j: int) -> None:
        if phase == "reduce" and step == job.kill_step and j >= 1:
            os.kill(os.getpid(), signal.SIGKILL)

    return Hooks(at_phase=at, scheduled_joins=joins)


def rank_main(job: Job, run: str, port: str, replica: int, incarnation: int, rank: int) -> None:
    """One rank (a forked child): what a torchrun worker of the replica would run."""
    log = job.out / run / f"replica{replica}-{incarnation}-rank{rank}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(level=logging.INFO, force=True,
                        format="%(asctime)s %(name)s: %(message)s")
    os.environ.update(RECOVER_COORDINATOR=f"127.0.0.1:{port}", RECOVER_REPLICA=str(replica),
                      RANK=str(rank), WORLD_SIZE=str(job.ranks), LOCAL_RANK=str(rank),
                      RECOVER_INCARNATION=str(incarnation))
    # a fresh store per incarnation: the dead one's keys are stale
    store = job.out / run / f"pg-{replica}-{incarnation}"
    dist.init_process_group("nccl" if job.device == "cuda" else "gloo",
                            init_method=f"file://{store}", rank=rank, world_size=job.ranks)
    config = recover_config(llama3_debugmodel(), microbatches=job.n)
    config.hf_assets_path = job.tokenizer
    config.training.seq_len, config.training.steps = SEQ_LEN, job.steps
    config.training.local_batch_size = ROWS // job.ranks  # a microbatch: ROWS rows over ranks
    config.training.mixed_precision_param = "float32"  # the test compares fp32 losses
    # FSDP2 by fully_shard on plain parameters (the spmd_types default needs its own runtime)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.dataloader = IdDataLoader.Config(dataset_path=job.text, seed=0)
    config.validator.enable = False  # its loader is torchtitan's c4_test, not shipped here
    # torchtitan's checkpointer, by the lowest replica of the step's generation, into
    # OUT/{run}/checkpoint/step-N: the kill run saves step STEPS-1 (the resume's start) and the
    # last step; the others only the last (the interval is past the end)
    config.dump_folder = str(job.out / run)
    config.checkpoint.enable = True
    config.checkpoint.interval = job.steps - 1 if run == "kill" else 10 * job.steps
    trainer = RecoverTrainer(config, hooks=hooks(job, run, replica, incarnation, rank))
    results = trainer.train()
    params = trainer.full_params()
    trainer.close()
    if rank == 0:
        rows = {s: [r.loss, r.microbatches, r.members] for s, r in results.items()}
        Path(job.out, run, f"replica{replica}.json").write_text(json.dumps(
            {"steps": rows, "start": trainer.replica.start_step}))
        torch.save(params, Path(job.out, run, f"params{replica}.pt"))
    dist.destroy_process_group()


def wait_port(path: Path, deadline: float) -> str:
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise TimeoutError(f"no coordinator port in {path}")


def supervise(job: Job, ports: dict[str, str], deadline: float,
              replicas: list[tuple[str, int]]) -> int:
    """Start each (run, replica)'s ranks; restart replica 1 of the kill run once (its other rank
    killed first, as torchrun's agent does); 0 when every replica's last ranks exited 0."""
    ctx = mp.get_context("fork")

    def start(run: str, replica: int, inc: int) -> list:
        procs = [ctx.Process(target=rank_main, args=(job, run, ports[run], replica, inc, rank))
                 for rank in range(job.ranks)]
        for p in procs:
            p.start()
        return procs

    groups = {key: start(*key, 0) for key in replicas}
    restarts = {("kill", 1): 1}
    try:
        while time.monotonic() < deadline:
            for key, procs in groups.items():
                if any(p.exitcode not in (None, 0) for p in procs):
                    codes = [p.exitcode for p in procs]
                    for p in procs:
                        if p.is_alive():
                            p.kill()
                        p.join(10)
                    if not restarts.get(key):
                        print(f"{key} failed: exit codes {codes}", file=sys.stderr)
                        return 1
                    restarts[key] -= 1
                    print(f"{key} exit codes {codes}: restarted", file=sys.stderr)
                    groups[key] = start(*key, 1)
            if all(p.exitcode == 0 for procs in groups.values() for p in procs):
                return 0
            time.sleep(0.05)
        print(f"not done within {TIMEOUT_S} s", file=sys.stderr)
        return 1
    finally:
        for procs in groups.values():
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)


def main(argv: list[str]) -> int:
    out, tk, text, steps, n, kill_step, ref_port, kill_port, resume_port, ranks, device = argv
    job = Job(Path(out), tk, text, int(steps), int(n), int(kill_step), int(ranks), device)
    torch.set_num_threads(1)
    deadline = time.monotonic() + TIMEOUT_S
    for run in ("ref", "kill", "resume"):
        (job.out / run).mkdir(parents=True, exist_ok=True)
    ports = {run: wait_port(Path(f), deadline)
             for run, f in (("ref", ref_port), ("kill", kill_port), ("resume", resume_port))}
    code = supervise(job, ports, deadline, [("ref", 0), ("kill", 0), ("kill", 1)])
    if code:
        return code
    # the resume: a job started again from the kill run's step STEPS-1 save (its newest here)
    save = f"step-{job.steps - 1}"
    shutil.copytree(job.out / "kill" / "checkpoint" / save,
                    job.out / "resume" / "checkpoint" / save)
    return supervise(job, ports, deadline, [("resume", 0)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
