"""Fault injection at a chosen (replica, step, phase): real SIGKILL, real SIGSTOP, real slowness.

Invariant: a fault fires at most once, in the process of the replica it names, exactly at the
named point of the step protocol; nothing else about the run changes. A spec (CLI `--fault`,
repeatable) is `kind:key=value,...`; its grammar is the tables below (`KINDS`, `ALLOWED`,
`REQUIRED`, `PHASES`), which `parse_fault` enforces and `grammar()` renders for
`recover train --help`, so the help cannot drift from the parser.

`rank=K` picks one rank of a multi-rank replica (hsdp/tp/pp layouts); default: its last rank.
Every number is finite: X in (0, a week], F in [1, 1e5], R, S, J, K >= 0 and inside the run; a
spec that breaks any rule (or names a key twice) is refused in one line before the run starts.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from recover.errors import ConfigError
from recover.settings import SECONDS, Bounds, Hooks

log = logging.getLogger(__name__)

# Each phase: where in step S the fault fires.
PHASE_HELP = {
    "forward": "in the forward pass of local microbatch J (default 0)",
    "backward": "in the backward pass of local microbatch J (default 0)",
    "bucket": "while the first bucket of the gradient is reduced, the backward of this "
              "replica's last microbatch of step S still running (plain layout, a model of more "
              "than one bucket: --bucket-mb)",
    "reduce": "while the cross-replica reduce is in flight",
    "commit": "after the reduce, before the agreement",
    "optimizer": "after the commit decision",
    "donate": "a donor, as it starts streaming its state to a joiner at step S",
    "receive": "a joiner, as it starts receiving its state for admission at step S (the step of "
               "its restart fault)",
}
PHASES = tuple(PHASE_HELP)
# Each kind: what it does to the replica (or, for coordinator, to the coordinator).
KIND_HELP = {
    "kill": "SIGKILL this replica's process",
    "hang": "SIGSTOP it; SIGCONT after X seconds",
    "slow": "every microbatch takes F times as long (from step S, default 0)",
    "deadlock": "its main thread blocks for ever (heartbeats go on)",
    "partition": "its cross-replica traffic fails from step S on (heartbeats go on)",
    "restart": "the launcher starts replica R's processes again once step S-1 has committed "
               "(they rejoin the run)",
    "preempt": "SIGTERM this replica's process, as a scheduler preempting it would: it finishes "
               "the step and leaves at its boundary (a second SIGTERM: a crash)",
    "coordinator": "this replica SIGKILLs the coordinator's process (a local run: recover train "
                   "restarts it)",
    "drop": "test-only: this replica silently skips its local microbatch J of step S (no "
            "gradient, no loss) while the step still counts it: the data loss `recover verify` "
            "must catch",
}
KINDS = tuple(KIND_HELP)


@dataclass
class Fault:
    kind: str
    replica: int
    step: int = 0
    phase: str = "forward"
    microbatch: int = 0
    seconds: float = 0.0
    factor: float = 1.0
    rank: int | None = None  # rank within a multi-rank replica; None = its last rank

    def __str__(self) -> str:
        at = "" if self.rank is None else f",rank={self.rank}"
        if self.kind in ("restart", "partition"):
            return f"{self.kind}:replica={self.replica},step={self.step}{at}"
        if self.kind == "slow":
            return f"slow:replica={self.replica},factor={self.factor},step={self.step}{at}"
        if self.kind == "drop":
            return f"drop:replica={self.replica},step={self.step},microbatch={self.microbatch}{at}"
        extra = f",seconds={self.seconds}" if self.kind == "hang" else ""
        return (f"{self.kind}:replica={self.replica},step={self.step},phase={self.phase},"
                f"microbatch={self.microbatch}{extra}{at}")

    def target_rank(self, nranks: int) -> int:
        return nranks - 1 if self.rank is None else self.rank


# A `slow` factor above this is no slower replica but a stopped one (a 10 ms microbatch takes
# 17 minutes at 1e5); past it, `factor x` a microbatch's time overflows the timer's clock.
MAX_SLOW_FACTOR = 1e5
SLOW_FACTOR = Bounds(1.0, MAX_SLOW_FACTOR)
# Every key, in the order the grammar lists them, with the letter its value is named by.
KEYS = {"replica": "R", "step": "S", "seconds": "X", "factor": "F", "phase": "P",
        "microbatch": "J", "rank": "K"}
# The keys each kind takes, and those it cannot do without.
ALLOWED = {"kill": {"replica", "step", "phase", "microbatch", "rank"},
           "hang": {"replica", "step", "phase", "microbatch", "seconds", "rank"},
           "slow": {"replica", "factor", "step", "rank"},
           "deadlock": {"replica", "step", "phase", "microbatch", "rank"},
           "partition": {"replica", "step", "rank"},
           "restart": {"replica", "step"},
           "preempt": {"replica", "step", "phase", "microbatch", "rank"},
           "coordinator": {"replica", "step", "phase", "microbatch", "rank"},
           "drop": {"replica", "step", "microbatch", "rank"}}
REQUIRED = {"hang": {"replica", "step", "seconds"}, "slow": {"replica", "factor"}}
REQUIRED.update({k: {"replica", "step"} for k in KINDS if k not in REQUIRED})
EXAMPLES = ("kill:replica=1,step=10,phase=backward", "hang:replica=2,step=5,seconds=3")


def grammar() -> str:
    """The `--fault` grammar, rendered from the parser's tables (recover train --help)."""
    lines = ["--fault SPEC (repeatable): SPEC is kind:key=value,... ([...]: optional)", ""]
    for kind, what in KIND_HELP.items():
        keys = sorted(ALLOWED[kind], key=lambda k: (k not in REQUIRED[kind], list(KEYS).index(k)))
        spec = ",".join(f"{k}={KEYS[k]}" if k in REQUIRED[kind] else f"[{k}={KEYS[k]}]"
                        for k in keys).replace(",[", "[,")
        lines.append(f"  {kind}:{spec}")
        lines.append(f"      {what}")
    lines += ["", "phases (P, default forward):"]
    lines += [f"  {name:<10} {what}" for name, what in PHASE_HELP.items()]
    lines += ["", "rank=K: one rank of a multi-rank replica (hsdp, tp, pp; default its last); "
              f"X {SECONDS.describe()} s, F {SLOW_FACTOR.describe()}.",
              "examples:", *(f"  --fault {e}" for e in EXAMPLES)]
    return "\n".join(lines)


def parse_fault(spec: str) -> Fault:
    """Parse one `--fault` spec; ConfigError with the offending text on any mistake: an unknown
    kind, phase or key, a key given twice, a number that is malformed, not finite or out of range
    (`hang` seconds in SECONDS, `slow` factor in [1, MAX_SLOW_FACTOR], ids >= 0)."""
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"bad --fault {spec!r}: kind must be one of {', '.join(KINDS)}")
    fields = _fields(spec, rest)
    unknown = sorted(set(fields) - ALLOWED[kind])
    if unknown:
        raise ConfigError(f"bad --fault {spec!r}: unknown key(s) {', '.join(unknown)}")
    missing = [k for k in KEYS if k in REQUIRED[kind] - set(fields)]
    if missing:
        raise ConfigError(f"bad --fault {spec!r}: missing {'=, '.join(missing)}=")
    try:
        f = Fault(kind=kind, replica=int(fields["replica"]), step=int(fields.get("step", 0)),
                  phase=fields.get("phase", "forward"),
                  microbatch=int(fields.get("microbatch", 0)),
                  seconds=float(fields.get("seconds", 0)), factor=float(fields.get("factor", 1)),
                  rank=int(fields["rank"]) if "rank" in fields else None)
    except ValueError as e:
        raise ConfigError(f"bad --fault {spec!r}: {e}") from None
    if f.phase not in PHASES:
        raise ConfigError(f"bad --fault {spec!r}: phase must be one of {', '.join(PHASES)}")
    checks = [("seconds=", f.seconds, SECONDS, "hang"),
              ("factor=", f.factor, SLOW_FACTOR, "slow")]
    for name, value, bounds, applies in checks:
        if kind == applies:
            try:
                bounds.check(name, value, integer=False)
            except ConfigError as e:
                raise ConfigError(f"bad --fault {spec!r}: {e}") from None
    if f.replica < 0 or f.step < 0 or f.microbatch < 0 or (f.rank is not None and f.rank < 0):
        raise ConfigError(f"bad --fault {spec!r}: replica, step, microbatch and rank must be >= 0")
    return f


def _fields(spec: str, rest: str) -> dict[str, str]:
    """The key=value pairs of a spec, each key once."""
    fields: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        if not eq:
            raise ConfigError(f"bad --fault {spec!r}: expected key=value, got {part!r}")
        if k.strip() in fields:
            raise ConfigError(f"bad --fault {spec!r}: {k.strip()}= given twice")
        fields[k.strip()] = v.strip()
    return fields


def validate_faults(specs: list[str], replicas: int, steps: int, nranks: int = 1,
                    microbatches: int | None = None) -> list[Fault]:
    """Every spec parsed, and aimed at a replica, rank, step (and, given N = `microbatches`, a
    local microbatch index < N) the run has; ConfigError (one line) on the first that is not."""
    faults = [parse_fault(s) for s in specs]
    for f in faults:
        if f.rank is not None and f.rank >= nranks:
            raise ConfigError(f"--fault {f}: rank {f.rank} does not exist (each replica has "
                              f"{nranks} rank(s))")
        if f.replica >= replicas:
            raise ConfigError(f"--fault {f}: replica {f.replica} does not exist "
                              f"(--replicas {replicas})")
        if f.step >= steps:
            raise ConfigError(f"--fault {f}: step {f.step} is past the last step ({steps - 1})")
        if microbatches is not None and f.microbatch >= microbatches:
            raise ConfigError(f"--fault {f}: microbatch {f.microbatch} does not exist (a replica "
                              f"computes at most --microbatches {microbatches} per step)")
    return faults


class FaultInjector:
    """The faults of one rank of one replica; `at(phase, step, j)` is called at each protocol
    point. `hooks()` is the one object through which they reach the library; the loop tells the
    injector which step it is in (`step`), for the faults that last from a step on."""

    def __init__(self, faults: list[Fault], replica: int, rank: int = 0, nranks: int = 1) -> None:
        self.all = list(faults)  # every replica's (a restart is scheduled run-wide)
        self.faults = [f for f in faults if f.replica == replica and f.target_rank(nranks) == rank]
        self.fired: set[int] = set()
        self.step = 0  # the step the loop is in
        # The coordinator's pid, for a `coordinator` fault (the loop points it at the store).
        self.coordinator_pid: Callable[[], int] = lambda: 0

    def hooks(self) -> Hooks:
        """The library's `Hooks`: faults at protocol points, a partition from its step on, and
        every `restart` fault's (replica, step), so no plan counts a replica before it rejoins."""
        return Hooks(at_phase=self.at, link_down=lambda: self.partitioned(self.step),
                     scheduled_joins={f.replica: f.step for f in self.all if f.kind == "restart"})

    def partitioned(self, step: int) -> bool:
        """Whether this rank's cross-replica traffic is cut at `step` (a `partition` fault)."""
        return any(f.kind == "partition" and step >= f.step for f in self.faults)

    def drops(self, step: int, j: int) -> bool:
        """Whether this rank skips its local microbatch `j` of `step` (a `drop` fault), once."""
        for idx, f in enumerate(self.faults):
            if f.kind == "drop" and idx not in self.fired and (f.step, f.microbatch) == (step, j):
                self.fired.add(idx)
                log.warning(f"injecting {f} (pid {os.getpid()})")
                return True
        return False

    def slow_factor(self, step: int) -> float:
        return max([f.factor for f in self.faults if f.kind == "slow" and step >= f.step],
                   default=1.0)

    def at(self, phase: str, step: int, j: int = 0) -> None:
        for idx, f in enumerate(self.faults):
            if idx in self.fired or f.kind in ("slow", "partition", "restart", "drop") or \
                    f.step != step or f.phase != phase:
                continue
            if phase in ("forward", "backward") and f.microbatch != j:
                continue
            self.fired.add(idx)
            log.warning(f"injecting {f} (pid {os.getpid()})")
            if phase == "reduce":
                time.sleep(random.uniform(0.0, 0.003))  # land inside the collective, not before
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "preempt":  # what a scheduler sends; the worker's handler takes it
                os.kill(os.getpid(), signal.SIGTERM)
            elif f.kind == "coordinator":
                pid = self.coordinator_pid()
                if pid <= 0:
                    raise RuntimeError(f"--fault {f}: the coordinator's pid is unknown")
                os.kill(pid, signal.SIGKILL)
            elif f.kind == "deadlock":
                # The main thread waits for ever on a lock nobody releases; the heartbeat and
                # liveness threads go on, so only evidence of no progress can evict it.
                threading.Event().wait()
            elif f.kind == "hang":
                # A detached helper resumes us: a real stop, seen by peers as a hung process.
                subprocess.Popen(["/bin/sh", "-c", f"sleep {f.seconds}; kill -CONT {os.getpid()}"],
                                 start_new_session=True, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
                os.kill(os.getpid(), signal.SIGSTOP)
