"""The settings every layer of the library reads, as config objects passed down unchanged.

Invariant: a fault-tolerance setting is declared once, here, and travels as the same object from
whoever builds it (the app's `RunConfig`, a user's loop, `recover coordinator`'s flags) down to
the coordinator, the member, the communicator and the step engine; no layer re-declares it as a
keyword of its own: the app's config and the coordinator's embed these classes (as subclasses)
instead. Every settings field, here, in the coordinator's and in the app's config, is declared by
one helper (`setting`: default, help, flag, choices, bounds), so a field's flag and help are
generated from its one declaration. Fault injection reaches the library only through one
`Hooks` object, and the launcher's environment variables are read in one place
(`LaunchEnv.from_env`). A replica's settings travel together as one `ReplicaConfig` (where and
who, `FaultTolerance`, `Numerics`). A settings object that exists holds usable values: each is
checked where it enters, against the bounds declared beside its field (`Bounds`), and a bad one
is a `ConfigError` of one line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from recover.errors import ConfigError

# (phase, step, microbatch index): called at each point of the step protocol where a fault may
# be injected ("forward", "backward", "reduce", "commit", "donate", "receive", ...).
PhaseHook = Callable[[str, int, int], None]


# The longest wait any setting may ask for. A longer one is a mistake (seconds typed for
# minutes), and every wait must stay a finite number far inside what `threading` and `time`
# accept (an infinite one never returns, a NaN one never fires, a huge one overflows).
MAX_WAIT_S = 7 * 24 * 3600.0
MAX_PORT = 65535
# The most replicas a run can have: the step's trailer sums per-replica rows in float32 limbs of
# at most 255 each, and 2^16 * 255 < 2^24 keeps those sums exact (recover.recovery.trailer).
MAX_REPLICAS = 1 << 16
# Numerics' names (recover.recovery.step.REDUCE_DTYPES maps the dtype names to torch's).
REDUCE_DTYPE_NAMES = ("", "fp32", "bf16", "fp16")  # "": the gradient's own dtype
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Bounds:
    """The values a numeric setting accepts: finite, of its field's type, in [lo, hi] (None: no
    bound on that side; an open side excludes its bound)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, x: float) -> bool:
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)

    def describe(self) -> str:
        """The accepted values in words: `>= 1`, `in (0, 0.5)`."""
        lo, hi = _num(self.lo), _num(self.hi)
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {hi}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"

    def check(self, name: str, value: object, integer: bool) -> None:
        """ConfigError naming `name` unless `value` is a finite number (an int if `integer`;
        never a bool) inside these bounds."""
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ConfigError(f"{name} must be {kind} (got {value!r})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number (got {value!r})")
        if not self.contains(value):
            raise ConfigError(f"{name} must be {self.describe()} (got {value!r})")


def _num(x: float | None) -> str:
    """A bound as written: 1, 0.5, 604800 (never 6.048e+05 or 1.0)."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return f"{x:g}" if isinstance(x, float) else str(x)


SECONDS = Bounds(0.0, MAX_WAIT_S, lo_open=True)  # a wait: > 0, finite, at most MAX_WAIT_S
PORT = Bounds(0, MAX_PORT)  # 0: any free port


class Number:
    """The command-line type of a numeric setting: it converts the text (argparse reports text
    that is no number) and carries the setting's `Bounds`, which its validation checks."""

    def __init__(self, kind: type, bounds: Bounds) -> None:
        self.kind, self.bounds = kind, bounds
        self.__name__ = kind.__name__  # argparse names the type in its message: "invalid int"

    def __call__(self, text: str) -> Any:
        return self.kind(text)


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = "",
            choices: tuple[str, ...] = (), trajectory: bool = False, const: Any = True,
            factory: Callable[[], Any] | None = None, metavar: str | None = None,
            bounds: Bounds | None = None) -> Any:
    """A settings field, declared once with everything said about it: its default, help text,
    command-line flag, choices and bounds (the library's settings, the coordinator's flags and
    the app's config all declare theirs with this).

    flag: "" = derived from the name (`microbatch_size` -> `--microbatch-size`), None = no flag.
    A bool field's flag takes no value and stores `const`; a list field's flag repeats (append).
    trajectory: the loss trajectory depends on this field (resume and reference must match it).
    bounds: a numeric field's accepted values (every int and float field declares them; checked
    by `check_fields`). No default and no `factory`: a required field.
    """
    meta: dict[str, Any] = {"help": help, "flag": flag, "choices": choices,
                            "trajectory": trajectory, "const": const, "metavar": metavar}
    if bounds is not None:
        meta["bounds"] = bounds
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field[Any]) -> str | None:
    """The command-line flag of a settings field (None: set only through a file or code)."""
    flag = f.metadata.get("flag", "")
    return ("--" + f.name.replace("_", "-")) if flag == "" else flag


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Any, label: Callable[[str], str] = str) -> None:
    """ConfigError (one line, naming the setting by `label(field name)`) unless every field of
    the dataclass `obj` holds a value of its type: a bool field a bool, a str field a str, a
    numeric field a finite number within the `Bounds` in its metadata."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value, typ = getattr(obj, f.name), hints[f.name]
        bounds, optional = f.metadata.get("bounds"), type(None) in typing.get_args(typ)
        if value is None and optional:
            continue
        if bounds is not None:
            bounds.check(label(f.name), value, typ is int or int in typing.get_args(typ))
        elif typ in (bool, str) and not isinstance(value, typ):
            kind = "true or false" if typ is bool else "a string"
            raise ConfigError(f"{label(f.name)} must be {kind} (got {value!r})")


def check_timeouts(ft: Any, label: Callable[[str], str] = str) -> None:
    """The relations between the protocol's bounds, on any object with `FaultTolerance`'s field
    names (the library's, or the app's config, whose `label` names its flags)."""
    if not ft.stale_s > 2 * ft.heartbeat_s:
        raise ConfigError(f"{label('stale_s')} ({ft.stale_s:g}) must exceed twice "
                          f"{label('heartbeat_s')} ({ft.heartbeat_s:g}): one late heartbeat "
                          "would declare a live replica lost")
    if not ft.reduce_timeout_s > ft.stale_s:
        raise ConfigError(f"{label('reduce_timeout_s')} ({ft.reduce_timeout_s:g}) must exceed "
                          f"{label('stale_s')} ({ft.stale_s:g}): it is the backstop behind hang "
                          "detection, and the protocol's waits for a new generation after a "
                          "hang take stale_s")


@dataclass(frozen=True)
class MemberTimeouts:
    """The two bounds a coordinator judges its members by, and the members run with: the
    silence that declares one lost, and how long joins may take. Declared here once for both:
    `FaultTolerance` (every member's settings) and the coordinator's `CoordinatorConfig` are
    each a `MemberTimeouts`, so neither re-declares them."""

    # Crashes are seen in ms (the liveness socket closes); this bounds only hang detection, so
    # a generous value costs little (a short one raises false alarms on a loaded machine).
    stale_s: float = setting(2.0, "heartbeat silence that declares a replica lost",
                             bounds=SECONDS)
    join_timeout_s: float = setting(120.0, "how long replicas wait for each other to join (the "
                                    "coordinator starts without those still missing after it, "
                                    "and gives up a joiner that got no state within it)",
                                    bounds=SECONDS)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class FaultTolerance(MemberTimeouts):
    """Detection bounds and timeouts of the protocol (every wait in it has one of these).
    Constructing one with a value out of its bounds raises `ConfigError`."""

    heartbeat_s: float = setting(0.1, "seconds between a replica's heartbeats", bounds=SECONDS)
    # Backstop of one cross-replica reduction, and of each of the step protocol's waits.
    reduce_timeout_s: float = setting(60.0, "backstop timeout of one reduction", bounds=SECONDS)
    # > 0: members keep their state this long for a coordinator that died to come back (an own
    # loop's `Replica.step` rejoins it by itself, as `recover train` does); 0: a death is final.
    coordinator_wait_s: float = setting(60.0, "how long replicas wait, keeping their state, for "
                                        "a coordinator that died to come back (0: stop at once)",
                                        bounds=Bounds(0.0, MAX_WAIT_S))
    # Below this many live replicas the run stops (BelowMinReplicas; `recover train`
    # checkpoints first).
    min_replicas: int = setting(1, "stop (with a checkpoint) below this many replicas",
                                bounds=Bounds(1))
    # Quotas follow measured replica speed. Off by default: following the clock regroups the N
    # microbatches, and fp32 sums of another grouping differ in their last bits, so a
    # failure-free run would not repeat bitwise (MEASUREMENTS.md, "Repeatable failure-free
    # runs"). With exact numerics any grouping sums to the same bits: on is free there.
    speed_aware: bool = setting(False, "quotas that follow measured replica speed instead of "
                                "equal ones (bitwise repeatable with --exact only)")

    def __post_init__(self) -> None:
        check_fields(self)
        check_timeouts(self)


@dataclass(frozen=True)
class Numerics:
    """How the cross-replica reduction travels. Unknown names raise `ConfigError`."""

    backend: str = setting("gloo", "cross-replica communicator: gloo, or nccl (CUDA tensors: "
                           "--device cuda)", choices=BACKENDS)
    reduce_dtype: str = setting("", "dtype the cross-replica reduce travels in (default: the "
                                "gradient's, fp32)", choices=REDUCE_DTYPE_NAMES, trajectory=True)
    exact: bool = setting(False, "bitwise-reproducible steps: fixed-point gradient sums that do "
                          "not depend on how microbatches are grouped or which replicas failed",
                          trajectory=True)
    # The reduce runs in buckets of about this many MiB (the first one issued: at most 1 MiB),
    # each started while the last microbatch's backward still runs, where the layout reports
    # finished gradients (plain); 0: one reduce after the backward (`recover.recovery.buckets`).
    bucket_mb: float = setting(25.0, "the cross-replica reduce runs in buckets of about this many "
                               "MiB, started while the last microbatch's backward still runs "
                               "(plain layout); 0: one reduce after the backward",
                               trajectory=True, bounds=Bounds(0.0, 1024.0), metavar="MB")

    def __post_init__(self) -> None:
        check_fields(self)
        for f in dataclasses.fields(self):
            names, value = f.metadata.get("choices", ()), getattr(self, f.name)
            if names and value not in names:
                raise ConfigError(f"{f.name} {value!r} is not one of "
                                  f"{', '.join(map(repr, names))}")


@dataclass
class Hooks:
    """Where an injected fault reaches into the library; every field is optional.

    `at_phase(phase, step, j)` runs at each protocol point; `link_down()` True makes this rank's
    cross-replica traffic fail (a partition); `scheduled_joins` {replica: step} holds the plan
    back from a replica that will join at that step (so its share is not planned before it is
    admitted); `seen_joins` (the library's) the scheduled replicas whose replacement this
    process already saw register or join: a plan never waits for one again, as it would when a
    restarted coordinator takes the run back to that step boundary.
    """

    at_phase: PhaseHook | None = None
    link_down: Callable[[], bool] | None = None
    scheduled_joins: Mapping[int, int] = field(default_factory=dict)
    seen_joins: set[int] = field(default_factory=set)

    def phase(self, phase: str, step: int, j: int = 0) -> None:
        if self.at_phase is not None:
            self.at_phase(phase, step, j)


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher tells a worker through its environment (read once, by `from_env`)."""

    coordinator: str | None = None  # RECOVER_COORDINATOR, "host:port"
    replica: int | None = None  # RECOVER_REPLICA
    rank: int = 0  # RANK: this process's rank within its replica (torchrun's variable)
    token: str | None = None  # RECOVER_RUN_TOKEN
    join_at: int = 0  # RECOVER_JOIN_AT: a replacement is not admitted before this step
    # RECOVER_INCARNATION (recover train's restarts) or TORCHELASTIC_RESTART_COUNT (torchrun's):
    # a restarted replica builds its own process group afresh under a new prefix.
    incarnation: str = "0"
    log_level: str = "info"  # RECOVER_LOG_LEVEL: one of LOG_LEVELS (`recover --log-level`)
    # RECOVER_WINDOWS_LOG: a folder where the app's ranks log which windows each microbatch read
    # (a debugging and testing aid: every window once per epoch is checked from these lines).
    windows_log: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, strict: bool = False) -> LaunchEnv:
        """The launcher's variables; one that is unset or malformed takes its default, or with
        `strict` (a worker's entry point) a malformed one is a `ConfigError` naming it."""
        env = os.environ if env is None else env
        level = env.get("RECOVER_LOG_LEVEL", "").strip().lower()
        if strict and level and level not in LOG_LEVELS:
            raise ConfigError(f"RECOVER_LOG_LEVEL={env['RECOVER_LOG_LEVEL']!r} is not one of "
                              f"{', '.join(LOG_LEVELS)}")
        coordinator = env.get("RECOVER_COORDINATOR") or None
        if strict and coordinator is not None:
            parse_address(coordinator, "RECOVER_COORDINATOR")
        return cls(coordinator=coordinator,
                   replica=_int(env, "RECOVER_REPLICA", strict),
                   rank=_int(env, "RANK", strict) or 0,
                   token=env.get("RECOVER_RUN_TOKEN", "").strip() or None,
                   join_at=_int(env, "RECOVER_JOIN_AT", strict) or 0,
                   incarnation=(env.get("RECOVER_INCARNATION")
                                or env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   log_level=level if level in LOG_LEVELS else "info",
                   windows_log=env.get("RECOVER_WINDOWS_LOG") or None)


def _int(env: Mapping[str, str], name: str, strict: bool) -> int | None:
    """The non-negative integer variable `name`; None when unset or (unless `strict`) not one."""
    text = env.get(name, "").strip()
    if text.isascii() and text.isdigit():  # ascii: "²".isdigit() too, and int() refuses it
        return int(text)
    if strict and text:
        raise ConfigError(f"{name}={env[name]!r} is not an integer >= 0")
    return None


def parse_address(text: str, name: str) -> tuple[str, int]:
    """(host, port) of `host:port`; ConfigError naming `name` unless the host is non-empty and
    the port a number in [1, MAX_PORT] (a port to connect to: 0 is none)."""
    host, colon, port = text.strip().rpartition(":")
    if not (colon and host and port.isascii() and port.isdigit()
            and 1 <= int(port) <= MAX_PORT):
        raise ConfigError(f"{name} {text!r} is not host:port (a port in [1, {MAX_PORT}])")
    return host, int(port)


INIT_CHECKS = ("check", "adopt", "off")  # ReplicaConfig.init


@dataclass(frozen=True)
class ReplicaConfig:
    """Where a replica's ranks join, who they say they are, and the settings they run with.

    `coordinator` ("host:port"), `replica` and `token` default to the launcher's environment
    (`launch`, itself `LaunchEnv.from_env()` when None); `resolved()` fills them in once, so
    every rank of a process reads the environment through the same object.
    """

    coordinator: str | None = None
    replica: int | None = None
    token: str | None = None  # the run's secret, shown at join (None: "-", any is accepted)
    fingerprint: str = "-"  # of the trajectory-defining config: another run's is refused
    ft: FaultTolerance = field(default_factory=FaultTolerance)
    numerics: Numerics = field(default_factory=Numerics)
    launch: LaunchEnv | None = None
    # What `Replica` enforces of the invariant by default (docs/porting.md), each with its opt-out:
    # the run's seed: each `compute(id, j)` runs on the RNG id_seed(seed, id, stream 1) (CPU and
    # the current CUDA device's), restored after; `id_rng=False`: the caller seeds itself.
    seed: int = setting(0, "the run's seed", bounds=Bounds(0))
    id_rng: bool = True
    # At join, this rank's initial model state is compared with the first replica's (a digest
    # per entry): "check" refuses a mismatch naming the first differing entry; "adopt" takes a
    # running replica's state instead (DDP's broadcast; a state transfer, needs the token);
    # "off" skips it.
    init: str = "check"
    # How long a replica tries to reach its coordinator before one line naming the address.
    connect_timeout_s: float = setting(30.0, "how long a replica tries to reach its "
                                       "coordinator", bounds=SECONDS)
    # SIGTERM (where the process has no handler of its own) is a planned leave at the next
    # step boundary: `Replica.step` then leaves and ends the process with exit code 0.
    sigterm_leaves: bool = True

    def __post_init__(self) -> None:
        check_fields(self)
        if self.init not in INIT_CHECKS:
            raise ConfigError(f"init {self.init!r} is not one of "
                              f"{', '.join(map(repr, INIT_CHECKS))}")

    def resolved(self) -> ReplicaConfig:
        """This config with every default taken from the launch environment; ValueError when the
        coordinator or the replica id is still unknown."""
        env = self.launch if self.launch is not None else LaunchEnv.from_env()
        out = replace(self, coordinator=self.coordinator or env.coordinator,
                      replica=env.replica if self.replica is None else self.replica,
                      token=self.token or env.token, launch=env)
        if not out.coordinator or out.replica is None:
            raise ValueError("recover: set RECOVER_COORDINATOR=host:port and RECOVER_REPLICA=i "
                             "(or pass ReplicaConfig(coordinator=..., replica=...))")
        return out

    def host_port(self) -> tuple[str, int]:
        """The coordinator's (host, port); the config must be `resolved()`."""
        if not self.coordinator:
            raise ValueError("recover: no coordinator address (ReplicaConfig.resolved() first)")
        return parse_address(self.coordinator, "the coordinator address")
