"""The settings every layer of the library reads, as config objects passed down unchanged.

Invariant: a fault-tolerance setting is declared once, here, and travels as the same object from
whoever builds it (the app's `RunConfig`, a user's loop, `recover coordinator`'s flags) down to
the coordinator, the member, the communicator and the step engine; no layer re-declares it as a
keyword of its own. Fault injection reaches the library only through one `Hooks` object, and the
launcher's environment variables are read in one place (`LaunchEnv.from_env`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher tells a worker through its environment (read once, by `from_env`)."""

    coordinator: str | None = None  # RECOVER_COORDINATOR, "host:port"
    replica: int | None = None  # RECOVER_REPLICA
    token: str | None = None  # RECOVER_RUN_TOKEN
    join_at: int = 0  # RECOVER_JOIN_AT: a replacement is not admitted before this step
    # RECOVER_INCARNATION (recover train's restarts) or TORCHELASTIC_RESTART_COUNT (torchrun's):
    # a restarted replica builds its own process group afresh under a new prefix.
    incarnation: str = "0"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if env is None else env
        replica = env.get("RECOVER_REPLICA", "")
        join_at = env.get("RECOVER_JOIN_AT", "0")
        return cls(coordinator=env.get("RECOVER_COORDINATOR") or None,
                   replica=int(replica) if replica.isdigit() else None,
                   token=env.get("RECOVER_RUN_TOKEN") or None,
                   join_at=int(join_at) if join_at.isdigit() else 0,
                   incarnation=(env.get("RECOVER_INCARNATION")
                                or env.get("TORCHELASTIC_RESTART_COUNT", "0")))
