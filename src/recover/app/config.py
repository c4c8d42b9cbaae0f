"""Run configuration: small typed sub-configs, presets, validation.

Invariant: a `RunConfig` that passed `validate()` describes a run that can start; everything a
failure-free run's trajectory depends on (model, data, seed, N, B, optimizer, schedule) is in it,
marked `trajectory=True` beside the field, and is saved as `DIR/config.json` (nested by
sub-config), so a resumed run or a reference run reproduces it exactly. Each field carries its own
help text, CLI flag name and choices (`recover.settings.setting` metadata): `recover.app.cli`
generates the `recover train` flags from them, so a field is documented in one place only. A
setting the library also reads is not declared here: `ft` is the library's `FaultTolerance` and
`compute` its `Numerics`, each embedded (subclassed) with the app's own fields beside it. Every
field is checked by `validate()` (or `checked()`, which also hands on the parsed fault specs):
its type, and a number finite and inside the `Bounds` declared beside it, so a value that would
break a run (a zero timeout, a NaN, a huge count) is a one-line `ConfigError` before anything
starts.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from recover.app import compat
from recover.app.faults import Fault, validate_faults
from recover.control.coordconfig import MAX_REPLICAS, store_shards_setting
from recover.data import SAMPLINGS
from recover.errors import ConfigError
from recover.layouts.mesh import LAYOUTS
from recover.recovery.step import MAX_MICROBATCHES
from recover.settings import (
    SECONDS,
    Bounds,
    FaultTolerance,
    Numerics,
    ReplicaConfig,
    check_fields,
    check_timeouts,
    flag_of,
    setting,
)

T = TypeVar("T")

POLICIES = ("recover", "shrink-batch")  # reactions to a lost replica (see `ft.policy`)
DTYPES = ("fp32", "bf16", "fp16")  # autocast / reduce dtypes (see `compute`)
# The step mark, (step + 1) x replicas, stays exact in float64 (< 2^53) for any run this short
# (recover.recovery.step, MAX_REPLICAS); and step x N, the ids, stays far inside int64.
MAX_STEPS = 1 << 36
# Model sizes and counts with no bound of their own: far past what one rank of this reference
# trainer can hold; a larger value is a typo, and index arithmetic stays far from overflow.
MAX_SIZE = 1 << 20
# Optimizer scalars with no natural ceiling (learning rate, weight decay, clip norm): far past any
# meaningful one, so a mistyped exponent is refused instead of training on NaN.
MAX_SCALAR = 1e6
POSITIVE = Bounds(0.0, MAX_SCALAR, lo_open=True)
FRACTION = Bounds(0.0, 1.0, hi_open=True)  # [0, 1): dropout, Adam's betas
STEPS = Bounds(0, MAX_STEPS)  # a count of steps, 0 allowed (0 = never / only at the end)
SIZE = Bounds(1, MAX_SIZE)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # Seconds on a laptop CPU: the preset the tests and the quick start use.
    "debug": dict(model=dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
                  data=dict(microbatches=8, microbatch_size=8, eval_every=10),
                  optim=dict(lr=3e-3, min_lr=3e-4, warmup_steps=5), run=dict(steps=40)),
    # Minutes on CPU (its step time: docs/MEASUREMENTS.md, "Threads and start-up").
    "small": dict(model=dict(block_size=128, n_layer=4, n_head=4, n_embd=128),
                  data=dict(microbatches=16, microbatch_size=8, eval_every=50),
                  optim=dict(lr=1e-3, min_lr=1e-4, warmup_steps=20), run=dict(steps=200)),
}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_choices(sub: Any, label: Callable[[str], str]) -> None:
    for f in dataclasses.fields(sub):
        choices, v = f.metadata.get("choices", ()), getattr(sub, f.name)
        _need(not choices or v in choices, f"unknown {label(f.name)} {v!r}; choose from "
              f"{', '.join(c or repr(c) for c in choices)}")


_hints = functools.cache(typing.get_type_hints)  # a sub-config class's field types


def _label(sub: Any) -> Callable[[str], str]:
    """How errors name a field of `sub`: its flag, or `section.field` for one without."""
    fields = {f.name: f for f in dataclasses.fields(sub)}
    return lambda name: flag_of(fields[name]) or f"{type(sub).__name__}.{name}"


def check_values(sub: Any, section: str) -> None:
    """`_check_fields`, naming each field `section.field` (a config file's key, not a flag)."""
    _check_fields(sub, lambda name: f"{section}.{name}")


def _check_fields(sub: Any, label: Callable[[str], str] | None = None) -> None:
    """Every field of a sub-config of its type: numbers finite and in their bounds
    (`recover.settings.check_fields`), a string non-empty unless "" is one of its choices, a
    list a list of strings, a choice one of its choices."""
    label = label or _label(sub)
    check_fields(sub, label)
    hints = _hints(type(sub))
    for f in dataclasses.fields(sub):
        v, typ = getattr(sub, f.name), hints[f.name]
        if typing.get_origin(typ) is list:
            _need(isinstance(v, list) and all(isinstance(x, str) for x in v),
                  f"{label(f.name)} must be a list of strings (got {v!r})")
        elif typ is str or str in typing.get_args(typ):  # str, or str | None
            _need(v is None or isinstance(v, str), f"{label(f.name)} must be a string (got {v!r})")
            _need(v is None or v.strip() != "" or "" in f.metadata.get("choices", ()),
                  f"{label(f.name)} must not be empty")
    _check_choices(sub, label)


@dataclass
class ModelConfig:
    """Shape of the decoder-only transformer (nanoGPT-style)."""

    # Grown to the data's vocabulary when it is prepared (token ids are stored as uint16 or
    # uint32: recover.data.tokens), so the bound is uint32's.
    vocab_size: int = setting(256, "vocabulary size (bytes: 256; grown to the data's)",
                              trajectory=True, bounds=Bounds(1, 1 << 32))
    block_size: int = setting(64, "sequence length", trajectory=True, bounds=Bounds(2, MAX_SIZE))
    n_layer: int = setting(2, "transformer blocks", trajectory=True, bounds=SIZE)
    n_head: int = setting(4, "attention heads", trajectory=True, bounds=SIZE)
    n_embd: int = setting(64, "model width", trajectory=True, bounds=SIZE)
    dropout: float = setting(0.0, "dropout probability (seeded per microbatch id)",
                             trajectory=True, bounds=FRACTION)
    bias: bool = setting(True, "biases in linear layers and norms", flag=None, trajectory=True)
    # Where the model comes from, not what it is: `identity` and `hf_config` (filled in at launch
    # by recover.app.train.foreign.resolve) are the trajectory, so a moved config folder resumes.
    name: str = setting("gpt", "the model: gpt (recover's own, shaped by the flags above), "
                        "hf:PATH (a transformers causal LM from PATH/config.json, random init) or "
                        "module:function (your factory f(vocab_size, block_size) -> nn.Module; "
                        "module: a dotted name or a path/to/file.py)", flag="--model",
                        metavar="MODEL")
    identity: str = setting("gpt", "what the model is: gpt, hf:<sha256 of its config>, or "
                            "module:<spec>", flag=None, trajectory=True)
    hf_config: dict[str, Any] | None = setting(None, "an hf: model's config.json, as read at "
                                               "launch", flag=None, trajectory=True)

    def validate(self) -> None:
        _check_fields(self)
        _need(self.n_embd % self.n_head == 0,
              f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        where, _, attr = self.name.rpartition(":")
        _need(self.name == "gpt" or (self.name.startswith("hf:") and self.name[3:].strip() != "")
              or (where != "" and all(p.isidentifier() for p in attr.split("."))),
              f"--model {self.name!r}: expected gpt, hf:PATH or module:function")
        _need(self.hf_config is None or isinstance(self.hf_config, dict),
              "ModelConfig.hf_config must be a JSON object")


@dataclass
class OptimConfig:
    """AdamW, linear warmup then cosine decay to min_lr, global-norm clipping."""

    lr: float = setting(3e-3, "peak learning rate", trajectory=True, bounds=POSITIVE)
    min_lr: float = setting(3e-4, "final learning rate of the cosine decay", trajectory=True,
                            bounds=Bounds(0.0, MAX_SCALAR))
    warmup_steps: int = setting(5, "linear warmup steps", trajectory=True, bounds=STEPS)
    weight_decay: float = setting(0.1, "AdamW weight decay", trajectory=True,
                                  bounds=Bounds(0.0, MAX_SCALAR))
    beta1: float = setting(0.9, "AdamW beta1", trajectory=True, bounds=FRACTION)
    beta2: float = setting(0.95, "AdamW beta2", trajectory=True, bounds=FRACTION)
    # 0 would scale every gradient to nothing: a run that trains nothing.
    grad_clip: float = setting(1.0, "global gradient-norm clip", trajectory=True,
                               bounds=POSITIVE)

    def validate(self) -> None:
        _check_fields(self)
        _need(self.min_lr <= self.lr, f"--min-lr must be in [0, lr={self.lr:g}] "
              f"(got {self.min_lr:g})")


@dataclass
class DataConfig:
    """The corpus and how a step's batch is cut: N (microbatches) is the invariant's unit."""

    path: str | None = setting(None, "a `recover prepare` folder, a text file/folder or a uint16 "
                               ".bin (default: embedded Shakespeare)", flag="--data",
                               trajectory=True)
    # epoch: what pre-training counts on (every window once per epoch, `epoch` in the metrics);
    # random: overlapping windows drawn with replacement (what a saved run without this field
    # drew: `recover.app.compat.saved_sampling`).
    sampling: str = setting("epoch", "training windows: epoch (each once per epoch, in an order "
                            "drawn from the seed) or random (drawn with replacement)",
                            choices=SAMPLINGS, trajectory=True)
    val_fraction: float = setting(0.1, "fraction of tokens held out for validation",
                                  trajectory=True, bounds=Bounds(0.0, 0.5, True, True))
    # The step's verification (count, id checksum) is exact for at most MAX_MICROBATCHES.
    microbatches: int = setting(8, "N: microbatches per step, the invariant's unit",
                                trajectory=True, bounds=Bounds(1, MAX_MICROBATCHES))
    microbatch_size: int = setting(8, "B: sequences per microbatch", trajectory=True,
                                   bounds=SIZE)
    eval_every: int = setting(10, "steps between validation losses (0 = only at the end)",
                              trajectory=True, bounds=STEPS)
    eval_microbatches: int = setting(4, "microbatches of each validation loss", trajectory=True,
                                     bounds=SIZE)

    def validate(self) -> None:
        _check_fields(self)


@dataclass(frozen=True)
class FaultToleranceConfig(FaultTolerance):
    """Detection, timeouts, the reaction to a lost replica, and injected faults.

    The library's `FaultTolerance`, embedded (every one of its settings is its declaration, with
    its flag, help and bounds), and the app's own settings beside it. Frozen, as the library's
    is: change it with `RunConfig.replace(ft=...)`. Unlike the library's, a value is checked by
    `validate()` (which names the flag, or a config file's `ft.key`), not as it is built.
    """

    # "recover" (in-step recovery, batch stays N) or "shrink-batch" (baseline,
    # recover.recovery.shrink: the faulted step is discarded, the batch shrinks). It changes
    # which gradients are applied, so it is part of the trajectory.
    policy: str = setting("recover", "reaction to a lost replica: recover, or shrink-batch "
                          "(baseline)", choices=POLICIES, trajectory=True)
    # A coordinator that dies is restarted (`recover coordinator --recover`); meanwhile the
    # replicas keep their state (`coordinator_wait_s`). Past that bound the last leader
    # checkpoints and all stop.
    coordinator_restarts: int = setting(3, "times `recover train` restarts a coordinator that "
                                        "died (0: never; the replicas then checkpoint and stop)",
                                        bounds=Bounds(0, MAX_SIZE))
    # What a scheduler allows between its SIGTERM and its SIGKILL (Kubernetes'
    # terminationGracePeriodSeconds defaults to 30 s; Slurm: --signal / KillWait): a preempted
    # replica that has not left by then ends as a crash, and `recover train` ends its processes.
    preempt_grace_s: float = setting(30.0, "seconds a SIGTERM (preemption) allows before the "
                                     "scheduler's SIGKILL: a replica leaves at the next step "
                                     "boundary, recover train checkpoints and exits 8 within it",
                                     bounds=SECONDS)
    # One store server handles every request on one thread: past ~1,000 ranks its serial work
    # per step outgrows the step's control plane (control/shards.py;
    # docs/DESIGN.md, "Scaling the control plane"). The coordinator's own setting, declared there.
    store_shards: int = store_shards_setting()
    faults: list[str] = setting(help="inject a fault (repeatable; its grammar and phases: at "
                                "the end), e.g. kill:replica=2,step=10,phase=backward",
                                flag="--fault", factory=list, metavar="SPEC")

    def __post_init__(self) -> None:
        """Nothing: `validate()` checks every field, naming it as its reader wrote it."""

    def validate(self) -> None:
        _check_fields(self)
        check_timeouts(self, _label(self))  # the library's rules, in this config's flags

    def to_library(self) -> FaultTolerance:
        """The library's `FaultTolerance`: every one of its settings, taken from this config's
        field of the same name (the app's own fields, policy, faults, ..., stay here)."""
        return _library(FaultTolerance, self)


@dataclass
class LayoutConfig:
    """How many replicas, and the parallelism inside one (recover.layouts)."""

    name: str = setting("plain", "replica layout: plain, hsdp, tp, pp or tp,pp (see README)",
                        flag="--layout", choices=LAYOUTS)
    replicas: int = setting(4, "R: replica processes (default 4)",
                            bounds=Bounds(1, MAX_REPLICAS))
    shards: int = setting(1, "hsdp: FSDP2 shard ranks per replica", bounds=SIZE)
    stages: int = setting(1, "pp, tp,pp: pipeline stages per replica", bounds=SIZE)
    tp: int = setting(1, "tp, tp,pp: tensor-parallel ranks per replica (per stage)", bounds=SIZE)

    def validate(self) -> None:
        _check_fields(self)

    def ranks_per_replica(self) -> int:
        """Processes per replica: 1 (plain), shards (hsdp), tp, stages, or tp x stages."""
        return {"plain": 1, "hsdp": self.shards, "tp": self.tp, "pp": self.stages,
                "tp,pp": self.tp * self.stages}[self.name]


@dataclass(frozen=True)
class ComputeConfig(Numerics):
    """Numerics and hardware: precision, exact mode, device and cross-replica backend.

    The library's `Numerics` (backend, reduce dtype, exact mode, buckets), embedded, and the
    app's precision and device beside it; frozen and checked by `validate()`, as
    `FaultToleranceConfig` is."""

    dtype: str = setting("fp32", "autocast dtype of forward/backward (parameters and optimiser "
                         "stay fp32)", choices=DTYPES, trajectory=True)
    device: str = setting("cpu", "cpu, or cuda (one GPU per process; plain layout)",
                          choices=("cpu", "cuda"))

    def __post_init__(self) -> None:
        """Nothing: `validate()` checks every field, naming it as its reader wrote it."""

    def validate(self) -> None:
        _check_fields(self)
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
                          f"{', '.join(PRESETS)}", choices=tuple(PRESETS))
    # Also the horizon of the LR schedule, so part of the trajectory.
    steps: int = setting(40, "optimizer steps", trajectory=True, bounds=Bounds(1, MAX_STEPS))
    stop_at: int = setting(0, "stop after this many steps (checkpointed; --resume goes on)",
                           bounds=STEPS)
    # torch.manual_seed takes 64 bits; the microbatch seeds mix it into 63 (workload.ids).
    seed: int = setting(1337, "run seed (data order, init, dropout)", trajectory=True,
                        bounds=Bounds(0, (1 << 63) - 1))
    out: str = setting("runs/recover", "run directory (default runs/<preset>-<time>)")
    ckpt_every: int = setting(0, "steps between DCP checkpoints (0 = only at the end)",
                              bounds=STEPS)
    resume: bool = setting(False, "continue from DIR's latest checkpoint")
    dump_final: bool = setting(False, "each finishing replica saves DIR/final/replica<i>.pt (to "
                               "compare them)", flag="--dump-final-params")
    reference: bool = setting(False, "also run the failure-free reference and compare "
                              "trajectories")
    # What the run is seen through; none of it touches the trajectory.
    tensorboard: str = setting("auto", "TensorBoard event files: a folder, auto (DIR/tensorboard "
                               "when the tensorboard package is installed) or none",
                               metavar="DIR")
    wandb: str | None = setting(None, "also log to this Weights & Biases project (off by "
                                "default; WANDB_MODE=offline works without a network)",
                                metavar="PROJECT")
    log_every: int = setting(1, "steps between progress lines when the output is not a terminal, "
                             "and in each replica's log (faults, recoveries, joins and val "
                             "losses are always shown)",
                             bounds=Bounds(1, MAX_STEPS), metavar="K")
    report: bool = setting(True, "do not write DIR/report (report.md and plots, ~1 s) at the end "
                           "of the run; `recover report DIR` writes it on demand",
                           flag="--no-report", const=False)

    def validate(self) -> None:
        _check_fields(self)
        _need(self.stop_at <= self.steps,
              f"--stop-at must be in [0, steps={self.steps}] (got {self.stop_at})")


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
            raise ConfigError(compat.flat_config_problem(flat, sections) or
                              f"unknown config field(s): {', '.join(flat)}")
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
            d = json.loads(p.read_text())
            if isinstance(d, dict):
                compat.saved_sampling(d)
            return cls.from_dict(d)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except OSError as e:
            raise ConfigError(f"cannot read the config file {p}: {e.strerror or e}") from None
        except (ValueError, TypeError, AttributeError, RecursionError) as e:  # JSON, UTF-8, shape
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
        """This config, if every field is of its type and in its bounds and the fields agree
        with each other (faults aimed at replicas, ranks and steps the run has); else the first
        problem as a one-line ConfigError."""
        self.checked()
        return self

    def checked(self) -> CheckedConfig:
        """`validate()`'s checks, and what they parsed: the one check of a launch (and of each
        of its ranks, which read config.json), whose result is handed on instead of checked
        or parsed again."""
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
        faults = validate_faults(ft.faults, lay.replicas, self.run.steps, lay.ranks_per_replica(),
                                 data.microbatches)
        return CheckedConfig(self, tuple(faults))

    def _validate_layout(self) -> None:
        """A multi-rank replica layout (recover.layouts) that can run this model and batch."""
        m, lay, b = self.model, self.layout, self.data.microbatch_size
        # tp and pp plans name the GPT's submodules (parallelize.py); FSDP2 needs no names.
        _need(m.name == "gpt" or lay.name in ("plain", "hsdp"),
              f"--model {m.name} supports --layout plain and hsdp only (got {lay.name}): the tp "
              "and pp plans are written for recover's GPT")
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


@dataclass(frozen=True)
class CheckedConfig:
    """A `RunConfig` that passed `RunConfig.checked()`, with its `--fault` specs parsed there:
    holding one says the checks ran, so whoever takes it (the launcher, its supervisor, a rank's
    loop) neither checks the config again nor parses a spec again (the specs' text stays in
    `cfg.ft.faults` only for config.json)."""

    cfg: RunConfig
    faults: tuple[Fault, ...]


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
