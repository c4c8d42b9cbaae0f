"""The settings every layer of the library reads, as config objects passed down unchanged.

Invariant: a fault-tolerance setting is declared once, here, and travels as the same object from
whoever builds it (the app's `RunConfig`, a user's loop, `recover coordinator`'s flags) down to
the coordinator, the member, the communicator and the step engine; no layer re-declares it as a
keyword of its own. Fault injection reaches the library only through one `Hooks` object, and the
launcher's environment variables are read in one place (`LaunchEnv.from_env`). A replica's
settings travel together as one `ReplicaConfig` (where and who, `FaultTolerance`, `Numerics`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

# (phase, step, microbatch index): called at each point of the step protocol where a fault may
# be injected ("forward", "backward", "reduce", "commit", "donate", "receive", ...).
PhaseHook = Callable[[str, int, int], None]


@dataclass(frozen=True)
class FaultTolerance:
    """Detection bounds and timeouts of the protocol (every wait in it has one of these)."""

    heartbeat_s: float = 0.1  # a member's heartbeat period
    # Heartbeat silence that declares a member lost. Crashes are seen in ms (the liveness socket
    # closes); this bounds only hang detection, so a generous value costs little.
    stale_s: float = 2.0
    reduce_timeout_s: float = 60.0  # backstop of one cross-replica reduction
    join_timeout_s: float = 120.0  # how long members wait for each other to join
    # > 0: members keep their state this long for a coordinator that died to come back.
    coordinator_wait_s: float = 0.0
    min_replicas: int = 1  # below this many live replicas the run stops (BelowMinReplicas)
    speed_aware: bool = True  # quotas follow measured replica speed


@dataclass(frozen=True)
class Numerics:
    """How the cross-replica reduction travels."""

    backend: str = "gloo"  # gloo, or nccl (CUDA tensors)
    reduce_dtype: str = ""  # "" (the gradient's), fp32, bf16 or fp16
    exact: bool = False  # fixed-point sums: bitwise independent of grouping and faults


@dataclass
class Hooks:
    """Where an injected fault reaches into the library; every field is optional.

    `at_phase(phase, step, j)` runs at each protocol point; `link_down()` True makes this rank's
    cross-replica traffic fail (a partition); `scheduled_joins` {replica: step} holds the plan
    back from a replica that will join at that step (so its share is not planned before it is
    admitted).
    """

    at_phase: PhaseHook | None = None
    link_down: Callable[[], bool] | None = None
    scheduled_joins: Mapping[int, int] = field(default_factory=dict)

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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if env is None else env
        level = env.get("RECOVER_LOG_LEVEL", "").lower()
        return cls(coordinator=env.get("RECOVER_COORDINATOR") or None,
                   replica=_int(env.get("RECOVER_REPLICA", "")),
                   rank=_int(env.get("RANK", "")) or 0,
                   token=env.get("RECOVER_RUN_TOKEN", "").strip() or None,
                   join_at=_int(env.get("RECOVER_JOIN_AT", "")) or 0,
                   incarnation=(env.get("RECOVER_INCARNATION")
                                or env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   log_level=level if level in LOG_LEVELS else "info")


def _int(text: str) -> int | None:
    """A non-negative integer variable; None when unset or not a number."""
    return int(text) if text.isdigit() else None


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
        host, port = self.coordinator.rsplit(":", 1)
        return host, int(port)
