"""A torchtitan job as one recover replica (`pip install recover[torchtitan]`).

Invariant: each replica is one torchtitan job on its own ranks (one `torchrun` per replica): its
model is torchtitan's (`config.model_spec`), built on meta and parallelised by torchtitan's own
`parallelize_fn` inside the replica (FSDP2 over the replica's ranks), and its optimizer, LR
scheduler, loss and checkpointer are torchtitan's builders. The data parallel dimension *across*
replicas is recover's: every step is `Replica.step` over the step's N microbatch ids, each id's
tokens a pure function of the id (`recover.data.IdBatches` over windows tokenised by torchtitan's
tokenizer), so a microbatch recomputed by a survivor is the lost one and every step has N
microbatches; the optimizer and scheduler step only after the step committed. A replica that
(re)joins mid-run receives the model, the optimizer's state and the scheduler's state live from a
running replica; a job started again loads torchtitan's newest checkpoint on every replica.

torchtitan's whole `Trainer` does not run on a host without an accelerator: with its device type
pointed at "cpu" its `set_device` passes, but its process group is NCCL (`distributed.utils` binds
its own device type) and its metrics' memory monitor calls `torch.cuda`. `cpu_fallback()` points
the device type that torchtitan's mesh builder reads at "cpu" so its `ParallelDims` and
`parallelize_fn` run on gloo, and `build_job` uses the builders the `Trainer` would, without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from recover.data import IdBatches
from recover.parallel import Replica
from recover.recovery import StepResult
from recover.settings import Hooks, ReplicaConfig

try:
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims
    from torchtitan.trainer import Trainer
except ImportError as e:  # one clear line naming the extra (the CLI prints it, no traceback)
    raise ImportError("recover.integrations.torchtitan needs torchtitan: pip install "
                      "'recover[torchtitan]' && pip install --no-deps torchtitan==0.3.0") from e

log = logging.getLogger(__name__)


def cpu_fallback() -> str:
    """The device type torchtitan's builders use here: the accelerator's, or "cpu" where there
    is none (torchtitan would say "cuda" and fail in `set_device`/`init_device_mesh`)."""
    if torch.accelerator.is_available():
        found = torch.accelerator.current_accelerator()
        if found is not None:
            return found.type
    # torchtitan reads its device type from module globals bound at import: rebind the two
    # that the mesh and the weight init read (the Trainer's own `set_device` stays unusable).
    import torchtitan.distributed.parallel_dims as pd
    import torchtitan.tools.utils as tu

    tu.device_type, tu.device_module = "cpu", torch.cpu
    pd.device_type = "cpu"
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


@dataclass
class TitanJob:
    """What a torchtitan `Trainer` would hold for one replica, built by its own builders."""

    config: Trainer.Config
    parallel_dims: ParallelDims
    model: nn.Module
    optimizers: Any  # torchtitan's OptimizersContainer
    lr_schedulers: Any  # torchtitan's LRSchedulersContainer
    loss_fn: Callable[..., tuple[Tensor, Any]]


def build_job(config: Trainer.Config) -> TitanJob:
    """This rank's part of the replica's torchtitan job: model (meta init, `parallelize_fn`
    unchanged, FSDP2 over the replica's ranks), optimizer, LR scheduler and loss."""
    device = cpu_fallback()
    spec = config.model_spec
    assert spec is not None, "the torchtitan config has no model_spec"
    world = dist.get_world_size()
    pdims = ParallelDims.from_config(config.parallelism, world_size=world)
    pdims.build_mesh()
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)  # as the Trainer does
    model_config = spec.model
    if device == "cpu":
        cpu_attention(model_config)
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model = spec.parallelize_fn(
        model, parallel_dims=pdims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint,
        dump_folder=config.dump_folder)
    if device == "cpu":  # gloo has no PREMUL_SUM: FSDP2 sums (torchtitan divides by 1.0 anyway)
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    # every rank of every replica the same initial weights (the Trainer seeds in set_determinism)
    torch.manual_seed(config.debug.seed if config.debug.seed is not None else 0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):  # as the Trainer does: the loss owns the head
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(optimizers=optimizers,
                                           training_steps=config.training.steps)
    return TitanJob(config, pdims, model, optimizers, schedulers, loss_fn)


class TokenWindows:
    """A map-style dataset of `seq_len + 1`-token windows (item i: tokens [i*L, i*L + L + 1))
    of texts tokenised once by torchtitan's tokenizer: `IdBatches` makes them id-addressable."""

    def __init__(self, tokenizer: Any, texts: Sequence[str], seq_len: int) -> None:
        ids: list[int] = []
        for t in texts:
            ids.extend(tokenizer.encode(t, add_bos=True, add_eos=True))
        self.tokens, self.seq_len = torch.tensor(ids, dtype=torch.long), seq_len
        if len(self) < 1:
            raise ValueError(f"{len(ids)} tokens make no window of {seq_len + 1}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> Tensor:
        return self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1]


def forward_loss(job: TitanJob, x: Tensor, y: Tensor, tokens: int) -> Tensor:
    """torchtitan's loss (the sum over the tokens of `y` / `tokens`) of `job.model` on inputs
    `x` [B, T]: as the Trainer's forward, each row one document (positions 0..T-1, causal)."""
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    kwargs: dict[str, Any] = {"positions": positions}
    inner = job.model.config.first_attention.inner_attention
    if _masked(inner):
        kwargs["attention_masks"] = job.model.get_attention_masks(positions=positions)
    pred = job.model(x, **kwargs)
    loss, _ = job.loss_fn(pred, y, torch.tensor(float(tokens)), positions=positions)
    return loss


def _masked(inner: Any) -> bool:
    """Whether this inner-attention config needs masks (Flex, Varlen), not SDPA's `is_causal`."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    return isinstance(inner, (FlexAttention.Config, VarlenAttention.Config))


class DataState:
    """The data loader's entry in torchtitan's checkpoint. recover's data has no position to
    save (a microbatch id names its tokens, and step t's ids are t*N..t*N+N-1), so what a resume
    must match is what the ids mean: N, the rows per microbatch and the epoch order's seed."""

    def __init__(self, batches: IdBatches, microbatches: int) -> None:
        self.value = {"microbatches": int(microbatches), "rows": batches.microbatch_size,
                      "seed": batches.seed, "items": batches.size}

    def state_dict(self) -> dict[str, int]:
        return dict(self.value)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {k: int(v) for k, v in state.items()}
        if saved != self.value:  # another N or data: the ids would name other tokens
            raise ValueError(f"the checkpoint's data {saved} is not this job's {self.value}")


class RecoverTrainer:
    """The torchtitan job of this rank's replica, stepped by recover (`train_step`)."""

    def __init__(self, config: Trainer.Config, batches: IdBatches, microbatches: int, *,
                 replica: ReplicaConfig | None = None, hooks: Hooks | None = None) -> None:
        self.job = build_job(config)
        self.batches, self.n = batches, microbatches
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        self.step = 0  # steps applied: torchtitan's "train_state" in its checkpoints
        # torchtitan's checkpointer, as its Trainer builds it (`config.checkpoint`): DCP over the
        # replica's ranks under `dump_folder/checkpoint/step-N`. Every replica loads the newest
        # one before joining the run (a resume: all start at its step); one replica saves.
        self.checkpointer = config.checkpoint.build(
            dataloader=DataState(batches, microbatches), model_parts=[self.job.model],
            optimizers=self.job.optimizers, lr_schedulers=self.job.lr_schedulers,
            states={"train_state": self}, sd_adapter=None, base_folder=config.dump_folder)
        if config.checkpoint.enable:
            self.checkpointer.load()
        # recover's view of the replica: one "shard" dimension over its ranks (FSDP2's).
        mesh = init_device_mesh("cpu", (self.ranks,), mesh_dim_names=("shard",))
        # The live transfer sends torch's optimizer (its state per parameter) and the scheduler.
        inner = self.job.optimizers.optimizers[0]
        self.replica = Replica(self.job.model, microbatches, mesh=mesh, optimizer=inner,
                               state={"lr_schedulers": self.job.lr_schedulers},
                               config=replica, hooks=hooks)
        if self.replica.joined:  # a running replica's state, newer than any checkpoint
            self.step = self.replica.start_step

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    def _compute(self, mb_id: int, j: int) -> float:
        """Forward + backward of this rank's rows of microbatch `mb_id`, the loss scaled by 1/N
        (FSDP2 averages over the replica's ranks); returns the rows' mean token loss."""
        w = self.batches.batch(mb_id, self.rank, self.ranks)
        x, y = w[:, :-1], w[:, 1:]
        # torchtitan's FSDP2 sums gradients over the ranks (divide factor 1): each rank's loss is
        # its tokens' sum over the whole microbatch's tokens; its rows' mean is that x ranks.
        loss = forward_loss(self.job, x, y, y.numel() * self.ranks)
        (loss / self.n).backward()
        return float(loss.detach()) * self.ranks

    def train_step(self, step: int) -> StepResult:
        """One step of N microbatches; torchtitan's optimizer and scheduler step on commit."""
        res = self.replica.step(step, self._compute)
        self.job.optimizers.step()
        self.job.lr_schedulers.step()
        self.job.optimizers.zero_grad()
        self.step = step + 1
        return res

    def save(self, res: StepResult, last: bool) -> None:
        """torchtitan's save policy (its interval, and the last step), by one replica: the
        lowest of the generation the step committed in. Every rank of every replica holds the
        same `res.members`, so a replica's ranks agree on it without a word (DCP's save is
        collective over them); a leader lost after the commit leaves this save point out."""
        if min(res.members) == self.replica.replica:
            with self.replica.busy():  # bounded on its own: no stuck-thread watchdog meanwhile
                self.checkpointer.save(self.step, last_step=last)

    def train(self, steps: int) -> dict[int, StepResult]:
        """Steps from where this replica starts (0, a checkpoint's step, or a joiner's
        `start_step`) to `steps`."""
        out = {}
        for step in range(self.step, steps):
            out[step] = res = self.train_step(step)
            self.save(res, last=step + 1 == steps)
            if self.rank == 0:
                log.info("replica %d step %d loss %.6f microbatches %d live %s",
                         self.replica.replica, step, res.loss, res.microbatches, res.members)
        return out

    def full_params(self) -> dict[str, Tensor]:
        """The model's whole parameters (every rank gathers them; FSDP2's shards joined)."""
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in self.job.model.state_dict().items()}


def load_config(spec: str) -> Trainer.Config:
    """`module:function` -> the `Trainer.Config` it returns (a torchtitan config registry entry,
    e.g. `torchtitan.models.llama3.config_registry:llama3_debugmodel`)."""
    import importlib

    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()
