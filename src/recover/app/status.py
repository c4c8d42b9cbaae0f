"""A run's state, read from its directory: the one status model of `recover status`, `recover
watch`, `recover report` and the launcher's HTTP endpoint (`/status`, `/metrics`).

Invariant: `read_status(DIR)` only reads (never writes, locks or connects to anything), returns a
plain JSON-serialisable dict, and works on a run that is still being written (a half-written last
line is skipped) as on a finished one; a directory that is not a run is one `ConfigError`. Every
fact comes from a file the run writes anyway: `config.json` (the plan), `run_start`,
`metrics.jsonl` (one line per committed step), `coordinator.jsonl` (the membership's events),
`store_stats.json` (the coordinator's count of main-store requests since it started) and, once
the launcher is done, `replica_exits.json` (how each replica ended) - so the views cannot
disagree with each other or with the files.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from recover.app import rundir
from recover.app.rundir import read_json, read_jsonl
from recover.control.membership import CONNECTION_CLOSED, FENCED, LEFT_CLEANLY, LOST
from recover.errors import ConfigError

RECENT = 20  # steps the step time, the throughput and the ETA are averaged over


def read_status(run_dir: Path | str, now: float | None = None) -> dict[str, Any]:
    """The status model of the run in `run_dir` (see the module docstring); ConfigError if it is
    not a run directory (no `config.json`)."""
    out = Path(run_dir)
    cfg = read_json(out / rundir.CONFIG)
    if not out.is_dir() or not isinstance(cfg, dict) or "run" not in cfg:
        raise ConfigError(f"{out}: not a recover run directory (no config.json)")
    now = time.time() if now is None else now
    replicas = int(cfg.get("layout", {}).get("replicas", 0))
    end = int(cfg["run"].get("stop_at") or cfg["run"].get("steps", 0))
    t0 = _run_start(out)
    recs = read_jsonl(out / rundir.METRICS)
    events = read_jsonl(out / rundir.COORDINATOR_LOG)
    exits = _finished_exits(out, t0)
    model: dict[str, Any] = {"dir": str(out), "state": _state(exits, recs, events),
                             "replicas": replicas, "steps": end, "run_start": t0}
    model.update(_progress(recs, end, t0, now, exits is not None))
    faults = _faults(events, recs, t0)
    model.update(_membership(events, recs, replicas, exits or {}))
    if exits is not None and recs:
        # Over, the coordinator's newest generations are the replicas leaving one by one: the
        # run's own last generation is the last committed step's.
        model["generation"] = recs[-1].get("generation")
    model["faults"] = faults
    model["recoveries"] = [{"step": r["step"], "time_s": r.get("time_s"),
                            "microbatches": len(r.get("recovered", [])),
                            "recovery_s": r.get("recovery_s", 0.0),
                            "attempts": r.get("attempts", 1)}
                           for r in recs if r.get("recovered") or r.get("attempts", 1) > 1]
    model["joins"] = [{"step": r["step"], "time_s": r.get("time_s"), "replicas": r["joined"],
                       "transfer_s": r.get("transfer_s")} for r in recs if r.get("joined")]
    model["coordinator_restarts"] = sum(e.get("event") == "resumed" for e in events)
    stats = read_json(out / rundir.STORE_STATS)
    model["store_requests"] = (stats.get("store_requests") if isinstance(stats, dict)
                               else None)
    model["exits"] = exits or {}
    return model


def _run_start(out: Path) -> float | None:
    try:
        return float((out / rundir.RUN_START).read_text())
    except (FileNotFoundError, ValueError):
        return None


def _finished_exits(out: Path, t0: float | None) -> dict[str, str] | None:
    """`replica_exits.json` if this launch wrote it (the launcher's last act); None while the run
    is going on. One older than `run_start` is an earlier launch's (a `--resume`d run)."""
    path = out / rundir.REPLICA_EXITS
    try:
        if t0 is not None and path.stat().st_mtime < t0:
            return None
    except FileNotFoundError:
        return None
    exits = read_json(path)
    return {str(k): str(v) for k, v in exits.items()} if isinstance(exits, dict) else None


def _state(exits: dict[str, str] | None, recs: list[dict], events: list[dict]) -> str:
    if exits is not None:
        return "finished"
    return "running" if recs or events else "starting"


def _progress(recs: list[dict], end: int, t0: float | None, now: float,
              finished: bool) -> dict[str, Any]:
    """Step, loss, throughput, elapsed time and ETA (from the last RECENT committed steps)."""
    if not recs:
        return {"step": None, "committed": 0, "loss": None, "val_loss": None,
                "tokens_per_s": None, "step_time_s": None, "elapsed_s": None, "eta_s": None,
                "generation": None, "quotas": {}}
    last, recent = recs[-1], recs[-RECENT:]
    times = [r["time_s"] for r in recent if "time_s" in r]
    # Commit to commit: includes recoveries and stalls, which is what the ETA must count.
    per_step = ((times[-1] - times[0]) / (len(times) - 1) if len(times) > 1
                else last.get("step_time_s"))
    tok = [r["tokens_per_s"] for r in recent if "tokens_per_s" in r]
    elapsed = (last.get("time_s") if finished or t0 is None else now - t0)
    remaining = max(0, end - (last["step"] + 1))
    return {"step": last["step"], "committed": len(recs), "loss": last.get("loss"),
            "val_loss": next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), None),
            "tokens_per_s": round(statistics.fmean(tok), 1) if tok else None,
            "step_time_s": round(statistics.median(r["step_time_s"] for r in recent
                                                   if "step_time_s" in r), 4)
            if any("step_time_s" in r for r in recent) else None,
            "elapsed_s": None if elapsed is None else round(elapsed, 2),
            "eta_s": None if per_step is None else round(remaining * per_step, 2),
            "generation": last.get("generation"), "quotas": last.get("quotas", {}),
            "mb_time_s": last.get("mb_time_s")}


def _step_at(recs: list[dict], t0: float | None, t: float) -> int | None:
    """The step in progress at absolute time t: the first not committed by then."""
    if t0 is None:
        return None
    done = sum(1 for r in recs if "time_s" in r and t0 + r["time_s"] <= t)
    return recs[0]["step"] + done if recs else 0


def _faults(events: list[dict], recs: list[dict], t0: float | None) -> list[dict[str, Any]]:
    """The coordinator's evidence against a replica (not a clean exit), and lost coordinators,
    with the step each came at. A survivor's report ('reduce failed at replica 0') names no
    replica: it is the same fault seen from elsewhere, not another one."""
    out = []
    for e in events:
        kind = e.get("event")
        if kind == "evidence" and e.get("replica") is not None \
                and not str(e.get("reason", "")).startswith(LEFT_CLEANLY):
            what = _ended(str(e.get("reason", "")))
        elif kind == "lost-before-start":
            what = LOST
        elif kind == "resumed":
            what = "coordinator restarted"
        else:
            continue
        t = float(e.get("time", 0.0))
        out.append({"time": t, "time_s": None if t0 is None else round(t - t0, 3),
                    "step": _step_at(recs, t0, t), "replica": e.get("replica"), "kind": what,
                    "reason": e.get("reason", "")})
    return out


def _membership(events: list[dict], recs: list[dict], replicas: int,
                exits: dict[str, str]) -> dict[str, Any]:
    """Each replica's state now (member / joining / lost / fenced / left cleanly / not joined)
    as the coordinator's events tell it, its quota and speed (seconds per microbatch) in the
    last committed step, how it ended."""
    state = {r: "not joined" for r in range(replicas)}
    since: dict[int, float | None] = {r: None for r in range(replicas)}
    why: dict[int, str] = {}
    members: list[int] = []
    generation, gens = None, []
    for e in events:
        kind, r = e.get("event"), e.get("replica")
        if kind == "hello" and r in state and state[r] != "member":
            state[r], since[r] = "joining", e.get("time")
        elif kind == "evidence" and r in state:
            why[r] = str(e.get("reason", ""))
        elif kind == "generation":
            generation, members = e.get("gen"), sorted(e.get("members", []))
            gens.append({"gen": generation, "time": e.get("time"), "members": members,
                         "reason": e.get("reason", "")})
            for m in state:
                if m in members and state[m] != "member":
                    state[m], since[m] = "member", e.get("time")
                elif m not in members and state[m] == "member":
                    state[m], since[m] = _ended(why.get(m, "")), e.get("time")
    quotas = recs[-1].get("quotas", {}) if recs else {}
    speeds = recs[-1].get("speeds", {}) if recs else {}
    table = [{"replica": r, "state": state[r], "since": since[r], "reason": why.get(r),
              "quota": quotas.get(str(r)), "mb_time_s": speeds.get(str(r)),
              "exit": exits.get(str(r))} for r in range(replicas)]
    return {"generation": generation if generation is not None else
            (recs[-1].get("generation") if recs else None),
            "members": members, "live_replicas": len(members),
            "step_members": recs[-1].get("members", []) if recs else [],
            "replica_states": table, "generations": gens}


def _ended(reason: str) -> str:
    """How a replica left the membership, in the words the launcher's summary uses."""
    if reason.startswith(LEFT_CLEANLY):  # "left cleanly (preempted)": a planned leave, no fault
        return reason
    if reason.startswith(CONNECTION_CLOSED):
        return LOST
    return FENCED  # dropped while its connection was open: silent, cut off or partitioned
