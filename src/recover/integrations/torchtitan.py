"""A torchtitan job as one recover replica (`pip install recover[torchtitan]`).

Invariant: each replica is one torchtitan `Trainer` on its own ranks (one `torchrun` per
replica): `RecoverTrainer` is a subclass whose `__init__` is torchtitan's own, so the model
(`config.model_spec`, its `parallelize_fn` unchanged: FSDP2 over the replica's ranks), the
optimizer, LR scheduler, loss, metrics and checkpointer are what torchtitan builds. The data
parallel dimension *across* replicas is recover's: every step is `Replica.step` over the step's N
microbatch ids, each microbatch the torchtitan `forward_backward_step` of tokens that are a pure
function of the id (`IdDataLoader`: torchtitan's tokenizer into id-addressed windows), so a
microbatch recomputed by a survivor is the lost one and every step has N microbatches; the
gradient is clipped, and the optimizer and scheduler step, only after the step committed. A
replica that (re)joins mid-run receives the model, the optimizer's and the scheduler's state live
from a running one; a job started again loads torchtitan's newest checkpoint on every replica.

On a host without an accelerator torchtitan's `Trainer` would ask for "cuda": `cpu_fallback()`
points the device type its modules bound at import at "cpu" (the mesh, the process group, the
weight init), gives its metrics a host stand-in for the device memory monitor (the one thing in
it that calls `torch.cuda` unconditionally), and each attention layer uses torchtitan's causal
SDPA (Flex has no CPU backward). With that the whole `Trainer.__init__` runs on CPU.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from recover.data import IdBatches, TokenWindows
from recover.recovery import StepResult
from recover.replica import Replica
from recover.settings import Hooks, ReplicaConfig

try:
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.trainer import Trainer
except ImportError as e:  # one clear line naming the extra (the CLI prints it, no traceback)
    raise ImportError(f"recover.integrations.torchtitan needs {e.name or 'torchtitan'}, which is "
                      "not installed: pip install 'recover[torchtitan]' && pip install --no-deps "
                      "torchtitan==0.3.0", name=e.name) from e

log = logging.getLogger(__name__)


class _HostMemory:
    """torchtitan's `DeviceMemoryMonitor` where there is no device: no device memory to report
    (its metrics line then says 0.00GiB), nothing to reset."""

    device_name = "cpu"

    def get_peak_stats(self) -> Any:
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(*([0] * len(DeviceMemStats._fields)))

    def reset_peak_stats(self) -> None:
        pass


def cpu_fallback() -> str:
    """The device type torchtitan's `Trainer` uses here: the accelerator's, or "cpu" where there
    is none (torchtitan would say "cuda" and fail in `set_device`)."""
    if torch.accelerator.is_available():
        found = torch.accelerator.current_accelerator()
        if found is not None:
            return found.type
    # torchtitan's modules bind the device type at import: rebind the ones the Trainer reads
    # (set_device and the weight init, the process group's backend, the mesh), and the monitor.
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as pd
    import torchtitan.distributed.utils as du
    import torchtitan.tools.utils as tu

    tu.device_type, tu.device_module = "cpu", torch.cpu
    du.device_type, du.device_module = "cpu", torch.cpu
    pd.device_type = "cpu"
    metrics.build_device_memory_monitor = _HostMemory
    return "cpu"


def cpu_attention(model_config: Any) -> None:
    """On a CPU host: each attention layer's inner attention becomes torchtitan's own
    `ScaledDotProductAttention` (causal). FlexAttention has no backward on CPU and Varlen no CPU
    kernel; with every window one document (positions 0..T-1) the three compute the same causal
    attention, so only the kernel changes."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model_config.layers:
        if getattr(layer, "attention", None) is not None:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()


def token_windows(tokenizer: Any, texts: list[str], seq_len: int) -> TokenWindows:
    """recover's `TokenWindows` of `seq_len + 1` tokens (window i: tokens [i*L, i*L + L + 1))
    over texts tokenised once by torchtitan's tokenizer: `IdBatches` makes them id-addressable."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer.encode(t, add_bos=True, add_eos=True))
    windows = TokenWindows([np.asarray(ids, dtype=np.int64)], seq_len)
    if len(windows) < 1:
        raise ValueError(f"{len(ids)} tokens make no window of {seq_len + 1}")
    return windows


def read_texts(path: str) -> list[str]:
    """The documents of a local file: one per line of a text file, or the "text" field of each
    line of a `.jsonl` file (the shape of torchtitan's c4 samples)."""
    lines = [x for x in Path(path).read_text().splitlines() if x.strip()]
    return [json.loads(x)["text"] for x in lines] if path.endswith(".jsonl") else lines


class IdDataLoader(BaseDataLoader):
    """torchtitan's data loader slot (`config.dataloader`), id-addressed: microbatch id i is the
    same tokens on whichever replica computes it (`IdBatches`: every window once per epoch, in
    an order drawn from `seed`), split over the replica's data-parallel ranks as torchtitan
    splits a local batch. Its checkpoint entry is what the ids mean (N, rows, seed, items), not a
    position: a resume with other data or another N is refused."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0
        """The epoch order's seed."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any,
                 seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
        if not config.dataset_path:
            raise ValueError("IdDataLoader.Config needs dataset_path (a local .txt or .jsonl)")
        windows = token_windows(tokenizer, read_texts(config.dataset_path), seq_len)
        self.batches = IdBatches(windows, local_batch_size * dp_world_size, seed=config.seed)
        self.rank, self.ranks = dp_rank, dp_world_size
        self.microbatches = 0  # N: set by the trainer (torchtitan builds the loader first)

    def batch(self, mb_id: int) -> tuple[dict[str, Tensor], Tensor]:
        """This rank's rows of microbatch `mb_id` as torchtitan's loaders yield them: inputs
        (each row one document: positions 0..T-1) and labels."""
        x, y = self.batches.batch(mb_id, self.rank, self.ranks)
        return {"input": x, "positions": torch.arange(x.shape[1]).expand(x.shape[0], -1)}, y

    def __iter__(self) -> Any:  # a plain Trainer reads the ids in order
        i = 0
        while True:
            yield self.batch(i)
            i += 1

    def state_dict(self) -> dict[str, int]:
        b = self.batches
        return {"microbatches": self.microbatches, "rows": b.microbatch_size, "seed": b.seed,
                "items": b.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, mine = {k: int(v) for k, v in state.items()}, self.state_dict()
        if saved != mine:  # another N or data: the ids would name other tokens
            raise ValueError(f"the checkpoint's data {saved} is not this job's {mine}")


@dataclass(kw_only=True, slots=True)
class FaultTolerance:
    """recover's settings beside torchtitan's (`RecoverTrainer.Config.fault_tolerance`)."""

    microbatches: int = 8
    """N: microbatches per step, the whole job's (each one `local_batch_size` rows per rank)."""
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    """Where to join and the protocol's settings (coordinator and replica id default to the
    launcher's environment: RECOVER_COORDINATOR, RECOVER_REPLICA)."""


class RecoverTrainer(Trainer):
    """torchtitan's `Trainer`, its data parallel dimension across replicas recover's."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    def __init__(self, config: Config, *, hooks: Hooks | None = None) -> None:
        if not isinstance(config.dataloader, IdDataLoader.Config):
            raise ValueError("RecoverTrainer needs config.dataloader = IdDataLoader.Config(...): "
                             "a microbatch id must name the same tokens on every replica")
        if cpu_fallback() == "cpu" and config.model_spec is not None:
            log.info("no accelerator: torchtitan on CPU, each attention layer causal SDPA")
            cpu_attention(config.model_spec.model)
        if config.debug.seed is None:  # every replica must start from the same weights
            log.info("debug.seed unset: seeding 0, so every replica starts from the same weights")
            config.debug.seed = 0
        super().__init__(config)
        if dist.get_world_size() > 1 and self.device.type == "cpu":
            # gloo has no PREMUL_SUM: FSDP2 sums (torchtitan's divide factor is 1 here anyway)
            from torch.distributed.fsdp import FSDPModule

            for m in self.model_parts[0].modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        ft = config.fault_tolerance
        self.n = ft.microbatches
        self.data: IdDataLoader = self.dataloader  # type: ignore[assignment]
        self.data.microbatches = self.n
        self.results: dict[int, StepResult] = {}
        # A resume: every replica loads the newest checkpoint before it joins; a joiner then
        # receives a running replica's state, newer than any checkpoint.
        if config.checkpoint.enable:
            self.checkpointer.load(step=config.checkpoint.load_step)
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),),
                                mesh_dim_names=("shard",))
        self.replica = Replica(self.model_parts[0], self.n, mesh=mesh,
                               optimizer=self.optimizers.optimizers[0],
                               state={"lr_schedulers": self.lr_schedulers},
                               config=ft.replica, hooks=hooks)
        if self.replica.joined:
            self.step = self.replica.start_step

    def _compute(self, mb_id: int, j: int) -> float:
        """torchtitan's forward + backward of this rank's rows of microbatch `mb_id`, the loss
        scaled by 1/N; returns the rows' mean token loss (what `Replica.step` sums over ranks)."""
        t0 = time.perf_counter()
        inputs, labels = self.data.batch(mb_id)
        self.metrics_processor.data_loading_times.append(time.perf_counter() - t0)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        # torchtitan's loss is the rank's token sum / global_valid_tokens: over the whole
        # microbatch's tokens (all ranks) x N, the step's gradient is the mean over N.
        tokens = labels.numel() * self.data.ranks
        loss = self.forward_backward_step(
            input_dict=inputs, labels=labels.to(self.device),
            global_valid_tokens=torch.tensor(float(tokens * self.n), device=self.device))
        self.metrics_processor.ntokens_since_last_log += labels.numel()
        return float(loss.detach()) * self.n * self.data.ranks

    def train_step(self, data_iterator: Any = None) -> StepResult:  # type: ignore[override]
        """Step `self.step` over its N ids (the iterator is not read: the ids are the data);
        torchtitan's clipping, optimizer and scheduler on the committed gradient."""
        step, cfg = self.step, self.config
        self.optimizers.zero_grad()
        res = self.replica.step(step, self._compute)
        grad_norm = self.replica.clip_grad_norm_(cfg.training.max_norm)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.step = step + 1
        # torchtitan's count of this rank's tokens, as if its replica computed every step alone
        # (whoever computed which ids): the same on every replica, so any one's checkpoint holds it
        rows = cfg.training.local_batch_size
        self.ntokens_seen = self.step * self.n * rows * cfg.training.seq_len
        if self.metrics_processor.should_log(self.step):
            self.metrics_processor.log(self.step, res.loss, res.loss, grad_norm,
                                       extra_metrics={"microbatches": res.microbatches})
        return res

    def save(self, res: StepResult) -> None:
        """torchtitan's save policy (its interval, and the last step), by one replica: the
        lowest of the generation the step committed in. Every rank of every replica holds the
        same `res.members`, so a replica's ranks agree on it without a word (DCP's save is
        collective over them); a leader lost after the commit leaves this save point out."""
        if min(res.members) == self.replica.replica:
            with self.replica.busy():  # bounded on its own: no stuck-thread watchdog meanwhile
                self.checkpointer.save(self.step,
                                       last_step=self.step == self.config.training.steps)

    def train(self) -> dict[int, StepResult]:  # type: ignore[override]
        """Steps from where this replica starts (0, a checkpoint's step, or a joiner's
        `start_step`) to `training.steps`; returns each step's result."""
        cfg = self.config
        with cfg.profiler.build(global_step=self.step, base_folder=cfg.dump_folder) as profiler:
            while self.should_continue_training():
                step = self.step
                self.gc_handler.run(step + 1)
                self.results[step] = res = self.train_step()
                self.save(res)
                if cfg.validator.enable and self.validator.should_validate(self.step):
                    self.validator.validate(self.model_parts, self.step)
                profiler.step()
                if dist.get_rank() == 0:
                    log.info("replica %d step %d loss %.6f microbatches %d live %s",
                             self.replica.replica, step, res.loss, res.microbatches,
                             res.members)
        return self.results

    def full_params(self) -> dict[str, Tensor]:
        """The model's whole parameters (every rank gathers them; FSDP2's shards joined)."""
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in self.model_parts[0].state_dict().items()}

    def close(self) -> None:
        """Leave the run (a clean exit, not a fault), then torchtitan's own close."""
        self.replica.leave()
        super().close()


def recover_config(config: Trainer.Config, **fault_tolerance: Any) -> RecoverTrainer.Config:
    """A torchtitan `Trainer.Config` (e.g. a config registry entry) as `RecoverTrainer`'s, with
    recover's settings beside it (`FaultTolerance`'s fields)."""
    own = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
    return RecoverTrainer.Config(**own, fault_tolerance=FaultTolerance(**fault_tolerance))


def load_config(spec: str) -> Trainer.Config:
    """`module:function` -> the `Trainer.Config` it returns (a torchtitan config registry entry,
    e.g. `torchtitan.models.llama3.config_registry:llama3_debugmodel`)."""
    import importlib

    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()
