"""The bench's fault schedule: successive replica kills, the same for every system.

Invariant: the schedule is a pure function of (R, steps, seed, kills): kill k (of `kills`, default
R // 2, "half of the replicas lost one by one" as in the paper) lands in the k-th of `kills` equal
windows of steps 1 .. steps-2, on a replica that is still alive, at a phase of the step protocol;
the step inside its window, the victim and the phase are drawn from `seed`. Nothing about it
depends on which system runs it; `remap` only renames replicas for a relaunch with fewer of them.
"""

from __future__ import annotations

import dataclasses
import random

from recover.app.faults import PHASES, Fault
from recover.errors import ConfigError

# Where a drawn kill may land: not `bucket`, which a model of one bucket never reaches.
KILL_PHASES = tuple(p for p in PHASES if p != "bucket")


def bench_schedule(replicas: int, steps: int, seed: int, kills: int | None = None) -> list[Fault]:
    """`kills` SIGKILLs spread over the run, one replica each, in step order."""
    kills = replicas // 2 if kills is None else kills
    if not 0 <= kills < replicas:
        raise ConfigError(f"--kills must be in [0, replicas) = [0, {replicas}) (got {kills})")
    if kills and steps < 2 * kills + 2:
        raise ConfigError(f"--steps {steps} is too short to spread {kills} kills over the run "
                          f"(need >= {2 * kills + 2})")
    rng = random.Random(seed)
    alive = list(range(replicas))
    lo, span = 1, steps - 2  # never the first step (nothing to lose) nor the last
    out = []
    for k in range(kills):
        a, b = lo + k * span // kills, lo + (k + 1) * span // kills
        victim = rng.choice(alive)
        alive.remove(victim)
        out.append(Fault("kill", victim, step=rng.randrange(a, b), phase=rng.choice(KILL_PHASES)))
    return out


def remap(faults: list[Fault], alive: list[int]) -> list[Fault]:
    """The faults of still-alive replicas, renamed to their index in `alive` (a relaunch's ids)."""
    new = {orig: i for i, orig in enumerate(alive)}
    return [dataclasses.replace(f, replica=new[f.replica]) for f in faults if f.replica in new]


def describe(faults: list[Fault]) -> str:
    return "; ".join(f"step {f.step} {f.phase}: kill replica {f.replica}" for f in faults) or "none"
