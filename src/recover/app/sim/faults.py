"""Failure sequences for the simulator: drawn, read from a trace, scheduled, or tied to steps.

Invariant: a `FaultSchedule` is built once per simulation and replayed unchanged for every policy,
so the three policies face the same physical failures (a timed fault names a replica *slot*, i.e. a
fixed group of GPUs, and a wall-clock time). A failure kills its GPU's whole replica; a slot fails
at most once (its GPUs are released), so later failures of the same slot are dropped here.

Slots `0 .. R-1` start active, slots `R .. R+spares-1` are spare replicas.

Trace file format (`--failure-trace`), failure times in hours since the job's start:
- CSV: one failure per line, `time_h` or `time_h,gpu`; an optional header line (`time_h,gpu`); lines
  starting with `#` are ignored.
- JSON: a list of numbers (`[0.5, 1.25]`), or a list of objects (`[{"time_h": 0.5, "gpu": 17}]`), or
  either of these under a `"failures"` key.
`gpu` is a global GPU index (`0 .. gpus + spares*gpus_per_replica - 1`, replica slot `gpu //
gpus_per_replica`); without it the failing slot is drawn (seeded) among the slots still healthy.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from recover.app.sim.inputs import parse_json, read_text
from recover.app.sim.params import SimParams
from recover.errors import ConfigError


@dataclass(frozen=True)
class Fault:
    """The replica slot `slot` is lost at wall time `time_s` (seconds since the job's start)."""

    time_s: float
    slot: int


@dataclass
class FaultSchedule:
    """Timed faults (same for every policy) and/or step faults (bench runs: `fault_steps`)."""

    timed: list[Fault] = field(default_factory=list)
    steps: list[int] = field(
        default_factory=list
    )  # kill the highest active slot during these steps
    source: str = "none"
    per_gpu_mttf_s: float | None = None  # exponential model: per-GPU MTTF
    mean_interval_s: float | None = None  # explicit schedules: mean time between faults

    def mtbf_s(self, active_gpus: int) -> float:
        """The job's mean time between faults with `active_gpus` GPUs (for Young-Daly)."""
        if self.per_gpu_mttf_s is not None:
            return self.per_gpu_mttf_s / max(1, active_gpus)
        if self.mean_interval_s is not None:
            return self.mean_interval_s
        return math.inf


def _dedupe(faults: list[Fault]) -> list[Fault]:
    seen: set[int] = set()
    out = []
    for f in sorted(faults, key=lambda f: (f.time_s, f.slot)):
        if f.slot not in seen:
            seen.add(f.slot)
            out.append(f)
    return out


def exponential_faults(n_slots: int, gpr: int, mttf_h: float, seed: int) -> list[Fault]:
    """Each GPU lives an exponential time of mean `mttf_h` (seeded); its replica dies with it."""
    rng = random.Random(seed)
    rate = 1.0 / (mttf_h * 3600.0)
    lives = [rng.expovariate(rate) for _ in range(n_slots * gpr)]  # GPU g is in slot g // gpr
    # A slot dies with its first GPU. Sorted as `_dedupe` sorts (time, then slot), with one
    # Fault per slot instead of per GPU: 131,072 GPUs made this most of a scale run's time.
    firsts = sorted((min(lives[s * gpr:(s + 1) * gpr]), s) for s in range(n_slots))
    return [Fault(t, s) for t, s in firsts]


def assign_slots(
    times_s: list[float], gpus: list[int | None], gpr: int, n_slots: int, seed: int
) -> list[Fault]:
    """Faults from times and optional GPU ids; a missing id draws a still-healthy slot (seeded)."""
    rng = random.Random(seed)
    healthy = set(range(n_slots))
    out = []
    for t, g in sorted(zip(times_s, gpus, strict=True), key=lambda x: x[0]):
        if g is not None:
            if not 0 <= g < n_slots * gpr:
                raise ConfigError(f"failure gpu {g} is outside 0..{n_slots * gpr - 1}")
            slot = g // gpr
        elif healthy:
            slot = rng.choice(sorted(healthy))
        else:
            continue
        healthy.discard(slot)
        out.append(Fault(t, slot))
    return _dedupe(out)


def _num(x: object, what: str) -> float:
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"failure trace: {what} {x!r} is not a number") from None
    if not math.isfinite(v) or v < 0:
        raise ConfigError(f"failure trace: {what} must be finite and >= 0, got {x!r}")
    return v


def load_trace(path: str) -> tuple[list[float], list[int | None]]:
    """Read a trace file (format: module docstring): failure hours, and GPU ids or None."""
    p = Path(path)
    text = read_text(path, "failure trace")
    times: list[float] = []
    gpus: list[int | None] = []
    if p.suffix.lower() == ".json" or text.lstrip()[:1] in ("[", "{"):
        data = parse_json(text, path, "failure trace")
        if isinstance(data, dict):
            data = data.get("failures")
        if not isinstance(data, list):
            raise ConfigError(f"failure trace {path}: expected a list of failures")
        for item in data:
            if isinstance(item, dict):
                if "time_h" not in item:
                    raise ConfigError(f"failure trace {path}: an entry has no time_h")
                times.append(_num(item["time_h"], "time_h"))
                g = item.get("gpu")
                gpus.append(None if g is None else int(_num(g, "gpu")))
            else:
                times.append(_num(item, "time_h"))
                gpus.append(None)
        return times, gpus
    for row in csv.reader(line for line in text.splitlines() if not line.startswith("#")):
        cells = [c.strip() for c in row if c.strip()]
        if not cells or cells[0].lower() == "time_h":
            continue
        times.append(_num(cells[0], "time_h"))
        gpus.append(int(_num(cells[1], "gpu")) if len(cells) > 1 else None)
    return times, gpus


def build_schedule(p: SimParams) -> FaultSchedule:
    """The failure sequence for `p`: fault_steps > fault_times_h > failure_trace > exponential."""
    n_slots = p.replicas + p.spares
    if p.fault_steps is not None:
        steps = sorted(p.fault_steps)
        mean = (p.total_steps or 1) * p.step_time_s / max(1, len(steps))
        return FaultSchedule(
            steps=steps,
            source=f"{len(steps)} replica kill(s) at steps {steps}",
            mean_interval_s=mean if steps else None,
        )
    if p.fault_times_h is not None or p.failure_trace is not None:
        if p.fault_times_h is not None:
            hours, gpus = list(p.fault_times_h), [None] * len(p.fault_times_h)
            source = f"{len(hours)} scheduled replica losses"
        else:
            hours, gpus = load_trace(p.failure_trace or "")
            source = f"trace {p.failure_trace} ({len(hours)} failures)"
        timed = assign_slots([h * 3600.0 for h in hours], gpus, p.gpus_per_replica, n_slots, p.seed)
        span = max((f.time_s for f in timed), default=0.0)
        mean = span / len(timed) if timed and span > 0 else None
        return FaultSchedule(timed=timed, source=source, mean_interval_s=mean)
    if p.per_gpu_mttf_h is None:
        return FaultSchedule(source="no failures")
    timed = exponential_faults(n_slots, p.gpus_per_replica, p.per_gpu_mttf_h, p.seed)
    return FaultSchedule(
        timed=timed,
        per_gpu_mttf_s=p.per_gpu_mttf_h * 3600.0,
        source=f"exponential per-GPU lifetimes, MTTF {p.per_gpu_mttf_h:,.0f} h, seed {p.seed}",
    )
