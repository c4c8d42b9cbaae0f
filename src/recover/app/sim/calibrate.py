"""Calibration from `recover bench`: the bench.json schema and the wall-time prediction.

Invariant: `predict_wall_times(calib)` simulates exactly the bench's run (its replicas, N, steps and
fault schedule) with the costs the bench measured, and nothing else; it never reads the measured
`wall_s`, so comparing the two validates the simulator (target: within 15% per system).

bench.json schema (one JSON object; times in seconds, steps 0-based as in docs/DESIGN.md, "The
invariant and its tolerances": step t consumes microbatch ids t*N .. t*N+N-1):

    {
      "schema": "recover.bench/1",     optional tag
      "replicas": 4,                   R, replicas at the start (int >= 1)
      "gpus_per_replica": 1,           optional, default 1
      "microbatches": 8,               N per step (int >= 1)
      "steps": 40,                     committed steps every system ran (int >= 1)
      "step_time_s": 0.21,             failure-free step with all R replicas (median, > 0)
      "microbatch_time_s": 0.045,      optional: one microbatch fwd+bwd on one replica;
                                       default (step_time_s - allreduce_s) / ceil(N / R)
      "allreduce_s": 0.019,            cross-replica gradient all-reduce (< step_time_s)
      "ckpt_cost_s": 0.3,              one blocking checkpoint save (ckpt-restart)
      "ckpt_every": 10,                optional: ckpt-restart's interval in steps;
                                       default Young-Daly from steps * step_time_s / faults
      "restart_cost_s": 6.0,           ckpt-restart: fault detected -> first step again
                                       (teardown, process start, imports, rendezvous, load)
      "detect_s": 1.0,                 kill -> survivors know (heartbeat threshold)
      "restart_detect_s": 0.1,         optional: kill -> ckpt-restart's supervisor knows;
                                       default detect_s
      "step_time_by_replicas_s": {"3": 0.19, "2": 0.24},
                                       optional: measured failure-free step time with r
                                       replicas (N over r); default from microbatch_time_s
      "rebuild_s": 0.02,               new communicator generation (recover, shrink-batch)
      "fault_steps": [10, 25],         one replica killed during each listed step (a step may
                                       repeat: several replicas at once); [] for none
      "fault_offset_frac": 0.5,        optional: where in the step's compute the kill lands
      "startup_s": 4.5,                optional: launch to first step, paid once by every system
      "tokens_per_microbatch": 512,    optional, default 1
      "wall_s": {"recover": 12.3, "ckpt-restart": 30.1, "shrink-batch": 11.9}
                                       measured wall time per system (needed only to validate)
      "per_system": {"shrink-batch": {"step_time_s": 0.2, "step_time_by_replicas_s": {...}}}
                                       optional: keys that replace the top-level ones when that
                                       system is simulated (e.g. step times measured in its own
                                       run, where the machine's load changed between the runs)
    }

Each step fault fires the first time a system executes that step (ckpt-restart does not re-fire it
when it replays the step after a restart).
"""

from __future__ import annotations

import math
from typing import Any

from recover.app.sim.engine import simulate
from recover.app.sim.inputs import parse_json, read_text
from recover.app.sim.params import POLICIES, SimParams
from recover.errors import ConfigError

REQUIRED = (
    "replicas",
    "microbatches",
    "steps",
    "step_time_s",
    "allreduce_s",
    "ckpt_cost_s",
    "restart_cost_s",
    "detect_s",
    "rebuild_s",
    "fault_steps",
)
COST_KEYS = ("ckpt_cost_s", "restart_cost_s", "detect_s", "rebuild_s", "restart_detect_s")


def load_calibration(path: str) -> dict[str, Any]:
    """Read and check a bench.json (schema in the module docstring); ConfigError if unusable."""
    calib = parse_json(read_text(path, "calibration file"), path, "calibration file")
    check_calibration(calib, path)
    return calib


def _nonneg(calib: dict[str, Any], key: str, where: str) -> None:
    v = calib[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{where}: {key} must be a number >= 0, got {v!r}")


def check_calibration(calib: Any, where: str = "calibration") -> None:
    """Raise ConfigError (one line) unless `calib` follows the bench.json schema."""
    if not isinstance(calib, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    missing = [k for k in REQUIRED if k not in calib]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")
    for key in REQUIRED + (
        "gpus_per_replica",
        "microbatch_time_s",
        "ckpt_every",
        "fault_offset_frac",
        "startup_s",
        "tokens_per_microbatch",
        "restart_detect_s",
    ):
        if key in calib and key != "fault_steps":
            _nonneg(calib, key, where)
    fs = calib["fault_steps"]
    if not isinstance(fs, list) or any(
        isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in fs
    ):
        raise ConfigError(f"{where}: fault_steps must be a list of step numbers >= 0")
    table = calib.get("step_time_by_replicas_s", {})
    if not isinstance(table, dict) or any(not str(k).isdigit() for k in table):
        raise ConfigError(f"{where}: step_time_by_replicas_s must map replica counts to seconds")
    for k in table:
        _nonneg(table, k, f"{where}: step_time_by_replicas_s")
    wall = calib.get("wall_s", {})
    if not isinstance(wall, dict) or any(k not in POLICIES for k in wall):
        raise ConfigError(f"{where}: wall_s must map some of {', '.join(POLICIES)} to seconds")
    for k in wall:
        _nonneg(wall, k, f"{where}: wall_s")
    per = calib.get("per_system", {})
    if not isinstance(per, dict) or any(k not in POLICIES or not isinstance(v, dict)
                                        or "per_system" in v for k, v in per.items()):
        raise ConfigError(f"{where}: per_system must map some of {', '.join(POLICIES)} to objects")


def calib_params(calib: dict[str, Any]) -> SimParams:
    """The `SimParams` of the bench run described by `calib` (validated)."""
    check_calibration(calib)
    gpr = int(calib.get("gpus_per_replica", 1))
    every = calib.get("ckpt_every")
    mb = calib.get("microbatch_time_s")
    rd = calib.get("restart_detect_s")
    table = {int(k): float(v) for k, v in calib.get("step_time_by_replicas_s", {}).items()}
    p = SimParams(
        gpus=int(calib["replicas"]) * gpr,
        gpus_per_replica=gpr,
        per_gpu_mttf_h=None,
        fault_steps=list(calib["fault_steps"]),
        fault_offset_frac=float(calib.get("fault_offset_frac", 0.5)),
        step_time_s=float(calib["step_time_s"]),
        microbatch_time_s=None if mb is None else float(mb),
        microbatches=int(calib["microbatches"]),
        tokens_per_microbatch=int(calib.get("tokens_per_microbatch", 1)),
        ckpt_interval_steps=None if every is None else int(every),
        ckpt_cost_s=float(calib["ckpt_cost_s"]),
        restart_cost_s=float(calib["restart_cost_s"]),
        detect_s=float(calib["detect_s"]),
        restart_detect_s=None if rd is None else float(rd),
        step_time_by_replicas=table or None,
        rebuild_s=float(calib["rebuild_s"]),
        allreduce_s=float(calib["allreduce_s"]),
        spares=0,
        total_steps=int(calib["steps"]),
        budget_h=None,
        startup_s=float(calib.get("startup_s", 0.0)),
        min_replicas=1,
    )
    return p.validate()


def predict_wall_times(calib: dict[str, Any]) -> dict[str, float]:
    """Predicted wall time (s) per system for the bench run in `calib` (same faults, same costs)."""
    res = simulate(calib_params(calib))
    out = {name: r.wall_s for name, r in res.items()}
    for name, over in calib.get("per_system", {}).items():
        out[name] = simulate(calib_params({**calib, **over}), (name,))[name].wall_s
    return out


def validation_rows(calib: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """(system, predicted_s, measured_s, relative error) for each system the bench measured."""
    pred = predict_wall_times(calib)
    rows = []
    for name, measured in calib.get("wall_s", {}).items():
        err = abs(pred[name] - measured) / measured if measured > 0 else math.inf
        rows.append((name, pred[name], float(measured), err))
    return rows
