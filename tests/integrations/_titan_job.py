"""One replica of the torchtitan test job (run under `torchrun`, one per replica).

argv: OUT TOKENIZER_DIR TEXT_FILE STEPS N KILL, KILL "-" or "REPLICA:STEP:J" (that replica's
rank 0 SIGKILLs itself in STEP's reduce once it holds J microbatches, first incarnation only:
torchrun's restart then rejoins with a live transfer). Rank 0 writes OUT/replica{R}.json (each
step's loss, microbatch count, live replicas; the start step) and OUT/params{R}.pt.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from recover.data import IdBatches
from recover.integrations.torchtitan import RecoverTrainer, TokenWindows
from recover.settings import Hooks

SEQ_LEN, ROWS = 32, 4  # tokens per row; rows per microbatch (split over the replica's ranks)


def kill_hook(spec: str, replica: int) -> Hooks:
    """A SIGKILL of this process at (step, j) if `spec` names this replica's first incarnation."""
    if spec == "-" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return Hooks()
    r, s, j = (int(v) for v in spec.split(":"))
    if r != replica or dist.get_rank() != 0:
        return Hooks()

    def at(phase: str, step: int, jj: int) -> None:
        if phase == "reduce" and step == s and jj >= j:
            os.kill(os.getpid(), signal.SIGKILL)

    return Hooks(at_phase=at)


def main(argv: list[str]) -> None:
    out, tk, text, steps, n, kill = argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    replica = int(os.environ["RECOVER_REPLICA"])
    config = llama3_debugmodel()
    config.hf_assets_path = tk
    config.training.seq_len, config.training.steps = SEQ_LEN, int(steps)
    config.training.mixed_precision_param = "float32"  # the test compares fp32 losses
    # FSDP2 by fully_shard on plain parameters (the spmd_types default needs its own runtime)
    config.parallelism.spmd_backend = "partial_dtensor"
    tokenizer = config.tokenizer.build(tokenizer_path=tk)
    data = TokenWindows(tokenizer, Path(text).read_text().splitlines(), SEQ_LEN)
    trainer = RecoverTrainer(config, IdBatches(data, ROWS, seed=0), int(n),
                             hooks=kill_hook(kill, replica))
    results = trainer.train(int(steps))
    params = trainer.full_params()
    trainer.replica.leave()
    if dist.get_rank() == 0:
        rows = {s: [r.loss, r.microbatches, r.members] for s, r in results.items()}
        Path(out, f"replica{replica}.json").write_text(json.dumps(
            {"steps": rows, "start": trainer.replica.start_step}))
        torch.save(params, Path(out, f"params{replica}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
