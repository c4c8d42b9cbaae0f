"""Run configuration: small typed sub-configs, presets, validation.

Invariant: a `RunConfig` that passed `validate()` describes a run that can start; everything a
failure-free run's trajectory depends on (model, data, seed, N, B, optimizer, schedule) is in it,
marked `trajectory=True` beside the field, and is saved as `DIR/config.json` (nested by
sub-config), so a resumed run or a reference run reproduces it exactly. Each field carries its own
help text, CLI flag name and choices (`setting(...)` metadata): `recover.app.cli` generates the
`recover train` flags from them, so a field is documented in one place only.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from recover.errors import ConfigError
from recover.parallel.mesh import LAYOUTS
from recover.settings import FaultTolerance, Numerics, ReplicaConfig

T = TypeVar("T")

POLICIES = ("recover", "shrink-batch")  # reactions to a lost replica (see `ft.policy`)
DTYPES = ("fp32", "bf16", "fp16")  # autocast / reduce dtypes (see `compute`)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # Seconds on a laptop CPU: the preset the tests and the quick start use.
    "debug": dict(model=dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
                  data=dict(microbatches=8, microbatch_size=8, eval_every=10),
                  optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=5), run=dict(steps=40)),
    # Minutes on CPU; ~0.2 s per step with 4 replicas on 2 cores.
    "small": dict(model=dict(block_size=128, n_layer=4, n_head=4, n_embd=128),
                  data=dict(microbatches=16, microbatch_size=8, eval_every=50),
                  optim=dict(lr=1e-3, min_lr=1e-4, warmup_steps=20), run=dict(steps=200)),
}


def setting(default: Any = None, help: str = "", *, flag: str | None = "",
            choices: tuple[str, ...] = (), trajectory: bool = False, const: Any = True,
            factory: Callable[[], Any] | None = None, metavar: str | None = None) -> Any:
    """A config field with its CLI metadata.

    flag: "" = derived from the name (`microbatch_size` -> `--microbatch-size`), None = no flag.
    A bool field's flag takes no value and stores `const`; a list field's flag repeats (append).
    trajectory: the loss trajectory depends on this field (resume and reference must match it).
    """
    meta: dict[str, Any] = {"help": help, "flag": flag, "choices": choices,
                            "trajectory": trajectory, "const": const, "metavar": metavar}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str | None:
    """The CLI flag of a config field (None: set only through config.json or code)."""
    flag = f.metadata.get("flag", "")
    return ("--" + f.name.replace("_", "-")) if flag == "" else flag


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choices(sub: Any) -> None:
    for f in dataclasses.fields(sub):
        choices, v = f.metadata.get("choices", ()), getattr(sub, f.name)
        _need(not choices or v in choices,
              f"unknown {flag_of(f)} {v!r}; choose from {', '.join(choices)}")


@dataclass
class ModelConfig:
    """Shape of the decoder-only transformer (nanoGPT-style)."""

    vocab_size: int = setting(256, "vocabulary size (bytes: 256)", trajectory=True)
    block_size: int = setting(64, "sequence length", trajectory=True)
    n_layer: int = setting(2, "transformer blocks", trajectory=True)
    n_head: int = setting(4, "attention heads", trajectory=True)
    n_embd: int = setting(64, "model width", trajectory=True)
    dropout: float = setting(0.0, "dropout probability (seeded per microbatch id)",
                             trajectory=True)
    bias: bool = setting(True, "biases in linear layers and norms", flag=None, trajectory=True)

    def validate(self) -> None:
        _need(self.n_layer >= 1 and self.n_head >= 1 and self.n_embd >= 1,
              "model sizes must be >= 1")
        _need(self.n_embd % self.n_head == 0,
              f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        _need(self.block_size >= 2, "block size must be >= 2")
        _need(0.0 <= self.dropout < 1.0, "dropout must be in [0, 1)")
        _need(1 <= self.vocab_size <= 65536, "vocab size must be in [1, 65536] (uint16 tokens)")


@dataclass
class OptimConfig:
    """AdamW, linear warmup then cosine decay to min_lr, global-norm clipping."""

    lr: float = setting(3e-3, "peak learning rate", trajectory=True)
    min_lr: float = setting(3e-4, "final learning rate of the cosine decay", trajectory=True)
    warmup_steps: int = setting(5, "linear warmup steps", trajectory=True)
    weight_decay: float = setting(0.1, "AdamW weight decay", trajectory=True)
    beta1: float = setting(0.9, "AdamW beta1", trajectory=True)
    beta2: float = setting(0.95, "AdamW beta2", trajectory=True)
    grad_clip: float = setting(1.0, "global gradient-norm clip", trajectory=True)

    def validate(self) -> None:
        _need(self.lr > 0, f"--lr must be > 0 (got {self.lr})")
        _need(0 <= self.min_lr <= self.lr, "--min-lr must be in [0, lr]")
        _need(self.warmup_steps >= 0, "--warmup-steps must be >= 0")


@dataclass
class DataConfig:
    """The corpus and how a step's batch is cut: N (microbatches) is the invariant's unit."""

    path: str | None = setting(None, "text file/folder or uint16 .bin (default: embedded "
                               "Shakespeare)", flag="--data", trajectory=True)
    val_fraction: float = setting(0.1, "fraction of tokens held out for validation",
                                  trajectory=True)
    microbatches: int = setting(8, "N: microbatches per step, the invariant's unit",
                                trajectory=True)
    microbatch_size: int = setting(8, "B: sequences per microbatch", trajectory=True)
    eval_every: int = setting(10, "steps between validation losses (0 = only at the end)",
                              trajectory=True)
    eval_microbatches: int = setting(4, "microbatches of each validation loss", trajectory=True)

    def validate(self) -> None:
        _need(self.microbatches >= 1, f"--microbatches must be >= 1 (got {self.microbatches})")
        _need(self.microbatch_size >= 1,
              f"--microbatch-size must be >= 1 (got {self.microbatch_size})")
        _need(self.eval_every >= 0, "--eval-every must be >= 0")
        _need(0.0 < self.val_fraction < 0.5, "--val-fraction must be in (0, 0.5)")
        _need(self.eval_microbatches >= 1, "--eval-microbatches must be >= 1")


@dataclass
class FaultToleranceConfig:
    """Detection, timeouts, the reaction to a lost replica, and injected faults."""

    min_replicas: int = setting(1, "stop (with a checkpoint) below this many replicas")
    speed_aware: bool = setting(True, "equal quotas instead of quotas that follow measured "
                                "replica speed", flag="--no-speed-aware", const=False)
    # "recover" (in-step recovery, batch stays N) or "shrink-batch" (baseline,
    # recover.recovery.shrink: the faulted step is discarded, the batch shrinks). It changes
    # which gradients are applied, so it is part of the trajectory.
    policy: str = setting("recover", "reaction to a lost replica: recover, or shrink-batch "
                          "(baseline)", choices=POLICIES, trajectory=True)
    heartbeat_s: float = setting(0.1, "seconds between a replica's heartbeats")
    # Crashes are seen in ms (the liveness socket closes); this only bounds hang detection.
    # 1.0 s raised false alarms at load average 14 on 2 cores; 2.0 s has not.
    stale_s: float = setting(2.0, "heartbeat silence that declares a replica lost")
    reduce_timeout_s: float = setting(60.0, "backstop timeout of one reduction")
    join_timeout_s: float = setting(120.0, "how long replicas wait for each other to join")
    # A coordinator that dies is restarted (`recover coordinator --recover`); meanwhile the
    # replicas keep their state. Past this bound the last leader checkpoints and all stop.
    coordinator_wait_s: float = setting(60.0, "how long replicas wait, keeping their state, for a"
                                        " coordinator that died to come back (0: stop at once)")
    coordinator_restarts: int = setting(3, "times `recover train` restarts a coordinator that "
                                        "died (0: never; the replicas then checkpoint and stop)")
    # One store server handles every request on one thread: past ~1,000 ranks its serial work
    # per step outgrows the step's control plane (collectives/shards.py;
    # docs/DESIGN.md, "Scaling the control plane").
    store_shards: int = setting(0, "store servers the coordinator also hosts for the step "
                                "decision's counts (0 or 1: none; ~1 per 1,000 ranks)")
    faults: list[str] = setting(help="inject a fault, e.g. kill:replica=2,step=10,"
                                "phase=backward", flag="--fault", factory=list, metavar="SPEC")

    def validate(self) -> None:
        _check_choices(self)
        _need(self.heartbeat_s > 0 and self.stale_s > 2 * self.heartbeat_s,
              "--stale-s must exceed twice the heartbeat interval")
        _need(self.coordinator_wait_s >= 0 and self.coordinator_restarts >= 0,
              "--coordinator-wait-s and --coordinator-restarts must be >= 0")
        _need(0 <= self.store_shards <= 256, "--store-shards must be in [0, 256]")

    def to_library(self) -> FaultTolerance:
        """The library's `FaultTolerance`: every one of its settings, taken from this config's
        field of the same name (the app's own fields, policy, faults, ..., stay here)."""
        return _library(FaultTolerance, self)


@dataclass
class LayoutConfig:
    """How many replicas, and the parallelism inside one (recover.parallel)."""

    name: str = setting("plain", "replica layout: plain, hsdp, tp, pp or tp,pp (see README)",
                        flag="--layout", choices=LAYOUTS)
    replicas: int = setting(4, "R: replica processes (default 4)")
    shards: int = setting(1, "hsdp: FSDP2 shard ranks per replica")
    stages: int = setting(1, "pp, tp,pp: pipeline stages per replica")
    tp: int = setting(1, "tp, tp,pp: tensor-parallel ranks per replica (per stage)")

    def validate(self) -> None:
        _need(self.replicas >= 1, f"--replicas must be >= 1 (got {self.replicas})")
        _check_choices(self)
        _need(self.shards >= 1 and self.stages >= 1 and self.tp >= 1,
              "--shards, --stages and --tp must be >= 1")

    def ranks_per_replica(self) -> int:
        """Processes per replica: 1 (plain), shards (hsdp), tp, stages, or tp x stages."""
        return {"plain": 1, "hsdp": self.shards, "tp": self.tp, "pp": self.stages,
                "tp,pp": self.tp * self.stages}[self.name]


@dataclass
class ComputeConfig:
    """Numerics and hardware: precision, exact mode, device and cross-replica backend."""

    dtype: str = setting("fp32", "autocast dtype of forward/backward (parameters and optimiser "
                         "stay fp32)", choices=DTYPES, trajectory=True)
    reduce_dtype: str = setting("", "dtype the cross-replica reduce travels in (default: the "
                                "gradient's, fp32)", choices=("", *DTYPES), trajectory=True)
    exact: bool = setting(False, "bitwise-reproducible steps: fixed-point gradient sums that do "
                          "not depend on how microbatches are grouped or which replicas failed",
                          trajectory=True)
    device: str = setting("cpu", "cpu, or cuda (one GPU per process; plain layout)",
                          choices=("cpu", "cuda"))
    backend: str = setting("gloo", "cross-replica communicator: gloo, or nccl (--device cuda)",
                           choices=("gloo", "nccl"))

    def validate(self) -> None:
        _check_choices(self)
        _need(self.backend == "gloo" or self.device == "cuda",
              "--backend nccl needs --device cuda")
        _need(not (self.exact and self.reduce_dtype),
              "--exact reduces int64 fixed point: drop --reduce-dtype")

    def to_library(self) -> Numerics:
        """The library's `Numerics` (backend, reduce dtype, exact mode) from this config."""
        return _library(Numerics, self)


@dataclass
class RunSettings:
    """Length, seed, outputs and checkpoints of one run."""

    preset: str = setting("debug", f"named defaults that other flags override: "
                          f"{', '.join(PRESETS)}")
    # Also the horizon of the LR schedule, so part of the trajectory.
    steps: int = setting(40, "optimizer steps", trajectory=True)
    stop_at: int = setting(0, "stop after this many steps (checkpointed; --resume goes on)")
    seed: int = setting(1337, "run seed (data order, init, dropout)", trajectory=True)
    out: str = setting("runs/recover", "run directory (default runs/<preset>-<time>)")
    ckpt_every: int = setting(0, "steps between DCP checkpoints (0 = only at the end)")
    resume: bool = setting(False, "continue from DIR's latest checkpoint")
    dump_final: bool = setting(False, "each finishing replica saves DIR/final/replica<i>.pt (to "
                               "compare them)", flag="--dump-final-params")
    reference: bool = setting(False, "also run the failure-free reference and compare "
                              "trajectories")

    def validate(self) -> None:
        _need(self.steps >= 1, f"--steps must be >= 1 (got {self.steps})")
        _need(0 <= self.stop_at <= self.steps, f"--stop-at must be in [0, steps={self.steps}]")
        _need(self.ckpt_every >= 0, "--ckpt-every must be >= 0")


@dataclass
class RunConfig:
    """Everything `recover train` needs, one sub-config per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    run: RunSettings = field(default_factory=RunSettings)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        sections = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        flat = sorted(k for k, v in d.items() if k not in sections or not isinstance(v, dict))
        if flat:
            old = {g.name for s in sections.values() for g in dataclasses.fields(s())}
            if set(flat) & (old | {"data", "layout"}):  # data, layout: flat-era field names
                raise ConfigError(
                    f"a flat (pre-sub-config) config with top-level {', '.join(flat)}: "
                    f"config.json is now nested by sub-config ({', '.join(sections)}); "
                    "start a new run, or move each field into its section")
            raise ConfigError(f"unknown config field(s): {', '.join(flat)}")
        parts: dict[str, Any] = {}
        for name, make in sections.items():
            values = d.get(name, {})
            known = {g.name for g in dataclasses.fields(make())}
            unknown = sorted(f"{name}.{k}" for k in set(values) - known)
            if unknown:
                raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
            parts[name] = make(**copy.deepcopy(values))
        return cls(**parts)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        p = Path(path)
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except (json.JSONDecodeError, TypeError, AttributeError) as e:
            raise ConfigError(f"config file {p} is not a valid recover config: {e}") from None
        except ConfigError as e:
            raise ConfigError(f"config file {p}: {e}") from None

    def replace(self, **sections: dict[str, Any]) -> RunConfig:
        """A deep copy with some fields changed, e.g. `cfg.replace(run={"out": d})`."""
        d = asdict(self)
        for name, changes in sections.items():
            if name not in d:
                raise ConfigError(f"unknown config section {name!r}")
            d[name].update(changes)
        return RunConfig.from_dict(d)

    def trajectory_key(self) -> dict[str, dict[str, Any]]:
        """The fields a loss trajectory depends on (resume and reference must match these)."""
        key: dict[str, dict[str, Any]] = {}
        for sec in dataclasses.fields(self):
            sub = getattr(self, sec.name)
            keep = {f.name: copy.deepcopy(getattr(sub, f.name)) for f in dataclasses.fields(sub)
                    if f.metadata.get("trajectory")}
            if keep:
                key[sec.name] = keep
        return key

    def validate(self) -> RunConfig:
        lay, data, ft = self.layout, self.data, self.ft
        lay.validate()
        data.validate()
        _need(lay.replicas <= data.microbatches,
              f"--replicas ({lay.replicas}) cannot exceed --microbatches ({data.microbatches}): "
              "every replica needs at least one microbatch per step")
        self.run.validate()
        self.optim.validate()
        _need(1 <= ft.min_replicas <= lay.replicas,
              f"--min-replicas must be in [1, replicas={lay.replicas}] (got {ft.min_replicas})")
        ft.validate()
        self.model.validate()
        self.compute.validate()
        _need(self.compute.device == "cpu" or lay.name == "plain",
              "--device cuda is implemented for --layout plain only")
        _need(not self.compute.exact or lay.name in ("plain", "hsdp"),
              f"--exact supports --layout plain and hsdp only (got {lay.name}): TP and pipeline "
              "ranks split a microbatch's reductions in layout-dependent ways")
        _need(ft.policy == "recover" or lay.name == "plain",
              f"--policy {ft.policy} supports --layout plain only")
        self._validate_layout()
        return self

    def _validate_layout(self) -> None:
        """A multi-rank replica layout (recover.parallel) that can run this model and batch."""
        m, lay, b = self.model, self.layout, self.data.microbatch_size
        uses = {"shards": lay.name == "hsdp", "tp": lay.name in ("tp", "tp,pp"),
                "stages": lay.name in ("pp", "tp,pp")}
        for name, used in uses.items():
            _need(used or getattr(lay, name) == 1,
                  f"--{name} {getattr(lay, name)} needs a --layout that uses it "
                  f"({'hsdp' if name == 'shards' else 'tp, pp or tp,pp'}; got {lay.name})")
        _need(b % lay.shards == 0,
              f"--microbatch-size ({b}) must be divisible by --shards ({lay.shards}): each "
              "shard rank takes an equal block of every microbatch")
        _need(m.n_head % lay.tp == 0,
              f"n_head ({m.n_head}) must be divisible by --tp ({lay.tp}): TP splits heads")
        _need(lay.stages <= m.n_layer,
              f"--stages ({lay.stages}) cannot exceed the number of layers ({m.n_layer})")
        _need(b % lay.stages == 0,
              f"--microbatch-size ({b}) must be divisible by --stages ({lay.stages}): each "
              "microbatch is split into that many pipeline chunks")


def _library(cls: type[T], sub: Any) -> T:
    """A library settings object built from the app config's fields of the same names."""
    return cls(**{f.name: getattr(sub, f.name) for f in dataclasses.fields(cls)
                  if hasattr(sub, f.name)})


def replica_config(cfg: RunConfig, coordinator: str, replica: int, token: str) -> ReplicaConfig:
    """The one translation of a run's config into what `recover.Replica` takes: where and who,
    the fault-tolerance settings and the numerics."""
    return ReplicaConfig(coordinator=coordinator, replica=replica, token=token,
                         fingerprint=fingerprint(cfg), ft=cfg.ft.to_library(),
                         numerics=cfg.compute.to_library())


def fingerprint(cfg: RunConfig) -> str:
    """16 hex digits of the trajectory-defining config: a worker of another run (another seed,
    N, model, data, optimizer) shows another fingerprint and is refused at join."""
    import hashlib

    return hashlib.sha256(json.dumps(cfg.trajectory_key(), sort_keys=True).encode()
                          ).hexdigest()[:16]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": x}} -> {"optim.lr": x} (to name differing fields in messages)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def preset(name: str) -> RunConfig:
    """A fresh config for a named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}")
    d = copy.deepcopy(PRESETS[name])
    d.setdefault("run", {})["preset"] = name
    return RunConfig.from_dict(d)
