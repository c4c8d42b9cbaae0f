"""Metrics: one JSON line per committed step in `DIR/metrics.jsonl`; the same to the console view
and the metrics writers (TensorBoard, W&B), with the run's events at their step.

Invariant: `metrics.jsonl` holds exactly one line per committed step, in step order, written by
the launcher from the step records the replicas publish in the store (`rec/{t}`: every live
replica offers one, they agree but for clocks), so a replica's death can never lose or duplicate a
line. The records are the app's keys:
their writer (train/loop.py) offers them, this sink deletes each once written out; the step
protocol's own keys are deleted by the protocol (recover.recovery.lifetime). A save point's line
carries the save's outcome (`ckpt`: the step written, or `ckpt_error`: why not, also printed as one
console line) whenever the writer lived to offer it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from recover.app.status import read_jsonl
from recover.app.train.progress import ProgressView
from recover.app.train.writers import Writers
from recover.collectives import keys
from recover.recovery import StepResult


class StepTimer:
    """A step's wall time, and its compute time per microbatch (all attempts); `microbatch(f)`
    also makes a straggler: the microbatch takes f times as long (the `slow` fault)."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.t0, self.busy_s, self.count = time.time(), 0.0, 0

    @contextmanager
    def microbatch(self, slow_factor: float = 1.0) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        if slow_factor > 1:
            time.sleep((slow_factor - 1) * (time.perf_counter() - t0))
        self.busy_s += time.perf_counter() - t0
        self.count += 1


def step_record(res: StepResult, lr: float, grad_norm: float, timer: StepTimer) -> dict[str, Any]:
    """The metrics line of a committed step, as a replica publishes it (`rec/{step}`)."""
    return {"step": res.step, "loss": res.loss, "lr": lr, "grad_norm": grad_norm,
            "microbatches": res.microbatches, "live_replicas": len(res.members),
            "members": res.members,
            "quotas": {str(k): v for k, v in res.quotas.items()},
            "generation": res.generation, "recovered": res.recovered,
            "recovery_s": round(res.recovery_s, 4), "attempts": res.attempts,
            "step_time_s": round(time.time() - timer.t0, 4), "t_commit": time.time(),
            "mb_time_s": round(timer.busy_s / max(1, timer.count), 5)}


SHOWN = ("events/fault", "events/join")  # the events the console view shows at their step


class MetricsSink:
    """Writes `metrics.jsonl` (see the module's invariant), and hands each line to the console
    view and to the metrics writers (TensorBoard, W&B: train/writers.py), with the run's events
    at that step: a replica lost or evicted (the coordinator's reason, from coordinator.jsonl),
    microbatches recovered, a replica joined, the coordinator restarted, a save that failed."""

    def __init__(self, store: Any, path: Path, start_step: int, steps: int, tokens_per_step: int,
                 run_start: float, view: ProgressView, writers: Writers | None = None) -> None:
        self.store, self.path = store, path
        self.next, self.steps = start_step, steps
        self.tokens_per_step = tokens_per_step
        self.run_start = run_start
        self.view = view
        self.writers = writers or Writers()
        self.records: list[dict[str, Any]] = []
        self._pending: list[tuple[str, str]] = []  # (tag, text) for the next committed step

    def note(self, tag: str, text: str) -> None:
        """An event seen between steps (a coordinator restart): written with the next step this
        sink writes, the one it was waiting for when the event came."""
        self._pending.append((tag, text))

    def close(self) -> None:
        """Stop the progress bar, flush and close every writer (once; whatever happened)."""
        self.view.close()
        self.writers.close()

    def poll(self) -> int:
        """Write every record that has arrived, in order; return how many were written."""
        n = 0
        while self.next < self.steps:
            rec = self._settled(self.next)
            if rec is None:
                break
            t_commit = rec.pop("t_commit")
            rec["time_s"] = round(t_commit - self.run_start, 4)
            rec["tokens"] = (rec["step"] + 1) * self.tokens_per_step
            rec["tokens_seen"] = rec["tokens"]  # trained on so far (ids are global: no recount)
            rec["tokens_per_s"] = round(self.tokens_per_step / max(rec["step_time_s"], 1e-9), 1)
            self._note_joins(rec)
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            events = self._events(rec)
            self.records.append(rec)
            # A save's failure and a coordinator restart were printed when they happened.
            self.view.step(rec, [text for tag, text in events if tag in SHOWN])
            self.writers.write(rec["step"], scalars_of(rec), _by_tag(events))
            self.next += 1
            n += 1
            self._forget(rec["step"] - 2)
        return n
    def _settled(self, step: int) -> dict[str, Any] | None:
        """The record of `step` to write, or None while there is none yet, or while a save
        point's record may still be replaced by the writer's (which carries the save's outcome:
        `ckpt` or `ckpt_error`). A `ckpt_pending` record (from a replica that did not write) is
        taken once the writer cannot offer its own any more: a record of the next step exists
        (a live writer offers its record before it counts that step), or the lowest of the
        step's members (the writer, as the replicas saw it) is no longer a member."""
        raw = keys.try_get(self.store, keys.record_key(step))
        if raw is None:
            return None
        rec = json.loads(raw)
        if not rec.get("ckpt_pending"):
            return rec
        if keys.try_get(self.store, keys.record_key(step + 1)) is None:
            writer = min(rec.get("members") or [-1])
            if writer in (keys.newest_members(self.store) or []):
                return None
        rec = json.loads(keys.try_get(self.store, keys.record_key(step)) or raw)  # theirs, now?
        rec.pop("ckpt_pending", None)
        return rec

    def _note_joins(self, rec: dict[str, Any]) -> None:
        """`joined`: replicas that are members now and were not at the previous step, with the
        time their state transfer took (published by the joiner)."""
        if not self.records or "members" not in self.records[-1]:
            return
        new = sorted(set(rec["members"]) - set(self.records[-1]["members"]))
        if not new:
            return
        rec["joined"] = new
        infos = [keys.try_get(self.store, keys.join_info_key(r)) for r in new]
        took = [json.loads(i)["transfer_s"] for i in infos if i]
        if took:
            rec["transfer_s"] = max(took)

    def _forget(self, step: int) -> None:
        """Delete the record of `step` (the app's key; the protocol deletes its own keys:
        recovery/lifetime.py). A record of step + 2 exists, so every live replica has counted
        step + 1, and its offer of this record (a `set`, sent before that count on the same
        client) was served already: the key is not re-created after it is deleted."""
        if step >= 0:
            self.store.delete_key(keys.record_key(step))

    def _events(self, rec: dict[str, Any]) -> list[tuple[str, str]]:
        """The run's events at this step, as (tag, text): replicas that left since the previous
        line (with the coordinator's reason: lost, evicted, fenced), microbatches recovered,
        replicas that joined, and what was noted in between (a coordinator restart)."""
        events, self._pending = self._pending, []
        prev = self.records[-1] if self.records else None
        if prev is not None and "members" in prev:
            gone = sorted(set(prev["members"]) - set(rec["members"]))
            if gone:
                why = self._reasons(prev["generation"], rec["generation"]) or "no reason logged"
                events.append(("events/fault", f"replica {', '.join(map(str, gone))} left the "
                               f"job: {why} (generation {rec['generation']})"))
        if rec["recovered"]:
            events.append(("events/fault", f"recovered {len(rec['recovered'])} microbatch(es) "
                           f"in {rec['recovery_s']:.2f}s ({rec['attempts']} attempts)"))
        elif rec["attempts"] > 1 and "joined" not in rec:  # a join's new plan is no fault
            events.append(("events/fault", f"step retried: {rec['attempts']} attempts in "
                           f"{rec['recovery_s']:.2f}s"))
        if "joined" in rec:
            took = f", state transfer {rec['transfer_s']:.2f}s" if "transfer_s" in rec else ""
            events.append(("events/join", f"replica {', '.join(map(str, rec['joined']))} joined "
                           f"(generation {rec['generation']}{took})"))
        if "ckpt_error" in rec:
            events.append(("events/checkpoint", str(rec["ckpt_error"])))
        return events

    def _reasons(self, after: int, upto: int) -> str:
        """The coordinator's reasons for generations after..upto (coordinator.jsonl: the one
        source that says why a member went: lost, evicted on evidence, fenced)."""
        # The coordinator may be writing its last line right now: read_jsonl skips that one.
        try:
            events = read_jsonl(self.path.parent / "coordinator.jsonl")
        except OSError:
            return ""
        gens = {e["gen"]: e.get("reason", "") for e in events if e.get("event") == "generation"}
        return "; ".join(gens[g] for g in range(after + 1, upto + 1) if gens.get(g))


def scalars_of(rec: dict[str, Any]) -> dict[str, float]:
    """Every numeric field of a metrics line (not the step: the x axis), and the count of
    microbatches recovered and of replicas joined."""
    out = {k: float(v) for k, v in rec.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    out["recovered_microbatches"] = float(len(rec.get("recovered") or []))
    out["joined_replicas"] = float(len(rec.get("joined") or []))
    return out


def _by_tag(events: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for tag, text in events:
        out[tag] = f"{out[tag]}; {text}" if tag in out else text
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: Path, keep_below_step: int) -> None:
    """Drop lines for steps >= keep_below_step (a resumed run rewrites them)."""
    if not path.exists():
        return
    keep = [r for r in read_metrics(path) if r["step"] < keep_below_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))
