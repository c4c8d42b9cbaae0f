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

Nothing read or written here ends the launcher. A record is sealed by its writer with the run
token (`recover.control.sealed`, bound to its key): one that does not open (written without the
token), is not JSON, or lacks a field of the right type is treated as absent and logged
(rate-limited, once per key per interval), so a stranger's value can at worst delay a line until
the replicas' own record replaces it. An append to `metrics.jsonl` the file system refuses (a full
disk, a quota, an I/O error) is reported once on the console, held in memory and retried, in order,
until it lands; a failed attempt is cut back to the last whole line first, so every line is written
exactly once, whole, when space returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from recover.app import rundir
from recover.app.rundir import read_jsonl
from recover.app.train.progress import ProgressView
from recover.app.train.writers import Writers
from recover.control import keys
from recover.control.sealed import open_value, rejected, seal
from recover.recovery import StepResult

log = logging.getLogger(__name__)

RETRY_S = 0.5  # how often an append the file system refused is tried again
_NUM = (int, float)
# The fields this sink and its views read from every record, and their types: a record without
# them is not one a replica wrote (`step_record`), whatever else it holds.
_FIELDS: dict[str, Any] = {"step": int, "t_commit": _NUM, "step_time_s": _NUM, "loss": _NUM,
                           "generation": int, "attempts": int, "members": list,
                           "recovered": list}
_OPTIONAL: dict[str, Any] = {"lr": _NUM, "grad_norm": _NUM, "live_replicas": int,
                             "recovery_s": _NUM, "mb_time_s": _NUM, "microbatches": int,
                             "quotas": dict}


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


def seal_record(token: str | None, step: int, rec: dict[str, Any]) -> str:
    """A step record as its writer stores it (`rec/{step}`): JSON sealed with the run token
    (`recover.control.sealed`), which the launcher's sink opens; ASCII throughout."""
    return seal(token, keys.record_key(step), json.dumps(rec).encode()).decode("ascii")


SHOWN = ("events/fault", "events/join")  # the events the console view shows at their step


class MetricsSink:
    """Writes `metrics.jsonl` (see the module's invariant), and hands each line to the console
    view and to the metrics writers (TensorBoard, W&B: train/writers.py), with the run's events
    at that step: a replica lost or evicted (the coordinator's reason, from coordinator.jsonl),
    microbatches recovered, a replica joined, the coordinator restarted, a save that failed."""

    def __init__(self, store: Any, path: Path, start_step: int, steps: int, tokens_per_step: int,
                 run_start: float, view: ProgressView, writers: Writers | None = None,
                 token: str | None = None) -> None:
        self.store, self.path = store, path
        self.token = token  # the run's: records that do not open with it are not the replicas'
        self.out = LineFile(path, self._say)
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
        """Write what is held (a last try), stop the progress bar, flush and close every writer
        (once; whatever happened)."""
        self.out.flush(force=True)
        if self.out.held:
            self._say(f"recover: {len(self.out.held)} line(s) of {self.path} could not be "
                      f"written ({self.out.error}); they are in `recover train`'s result only")
        self.view.close()
        self.writers.close()

    def _say(self, line: str) -> None:
        """A console line; one the console's file refuses (full too) is logged, not raised."""
        try:
            self.view.say(line)
        except OSError as e:
            log.warning("%s (console: %s)", line, e.strerror or e)

    def poll(self, final: bool = False) -> int:
        """Write every record that has arrived, in order; return how many were written.
        `final`: every replica has exited, so no writer can offer a record any more: a save
        point's `ckpt_pending` record is taken as it is (its writer died before its save)."""
        n = 0
        while self.next < self.steps:
            rec = self._settled(self.next, final)
            if rec is None:
                break
            t_commit = rec.pop("t_commit")
            rec["time_s"] = round(t_commit - self.run_start, 4)
            rec["tokens"] = (rec["step"] + 1) * self.tokens_per_step
            rec["tokens_seen"] = rec["tokens"]  # trained on so far (ids are global: no recount)
            rec["tokens_per_s"] = round(self.tokens_per_step / max(rec["step_time_s"], 1e-9), 1)
            self._note_joins(rec)
            self.out.append(json.dumps(rec) + "\n")
            events = self._events(rec)
            self.records.append(rec)
            # A save's failure and a coordinator restart were printed when they happened.
            try:
                self.view.step(rec, [text for tag, text in events if tag in SHOWN])
            except (KeyError, TypeError, ValueError, OSError) as e:  # a view never stops a run
                log.warning("step %d: not shown on the console: %r", rec["step"], e)
            self.writers.write(rec["step"], scalars_of(rec), _by_tag(events))
            self.next += 1
            n += 1
            self._forget(rec["step"] - 2)
        if not n:
            self.out.flush()  # held lines go out when space returns, steps or no steps
        return n

    def _settled(self, step: int, final: bool = False) -> dict[str, Any] | None:
        """The record of `step` to write, or None while there is none yet, or while a save
        point's record may still be replaced by the writer's (which carries the save's outcome:
        `ckpt` or `ckpt_error`). A `ckpt_pending` record (from a replica that did not write) is
        taken once the writer cannot offer its own any more: a record of the next step exists
        (a live writer offers its record before it counts that step), or the lowest of the
        step's members (the writer, as the replicas saw it) is no longer a member, or every
        replica has exited (`final`: a writer killed after the last step's commit)."""
        rec = self._record(step)
        if rec is None:
            return None
        if not rec.get("ckpt_pending"):
            return rec
        if not final and self._record(step + 1) is None:
            writer = min(rec["members"] or [-1])
            if writer in self._members():
                return None
        rec = self._record(step) or rec  # theirs, now?
        rec.pop("ckpt_pending", None)
        return rec

    def _record(self, step: int) -> dict[str, Any] | None:
        """The replicas' record of `step` in the store: None while there is none, and for one
        that is not theirs (see the module's invariant: logged, rate-limited, and ignored)."""
        key = keys.record_key(step)
        raw = open_value(self.token, key, keys.try_get(self.store, key))
        if raw is None:
            return None
        try:
            rec = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            rejected(key, f"not JSON ({len(raw)} bytes)")
            return None
        why = record_problem(rec, step)
        if why:
            rejected(key, why)
            return None
        return rec

    def _members(self) -> list[int]:
        """The newest generation's members, [] when the store's value cannot be read as such."""
        try:
            return list(keys.newest_members(self.store, self.token) or [])
        except (ValueError, TypeError) as e:
            rejected("gen/members", f"unreadable ({e})")
            return []

    def _note_joins(self, rec: dict[str, Any]) -> None:
        """`joined`: replicas that are members now and were not at the previous step, with the
        time their state transfer took (published by the joiner)."""
        if not self.records or "members" not in self.records[-1]:
            return
        new = sorted(set(rec["members"]) - set(self.records[-1]["members"]))
        if not new:
            return
        rec["joined"] = new
        took = [t for t in (self._transfer_s(r) for r in new) if t is not None]
        if took:
            rec["transfer_s"] = max(took)

    def _transfer_s(self, replica: int) -> float | None:
        """A joiner's state-transfer time (its `join/info` value), None when absent or unreadable:
        it only decorates a line."""
        key = keys.join_info_key(replica)
        raw = keys.try_get(self.store, key)
        if not raw:
            return None
        try:
            took = json.loads(raw)["transfer_s"]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            rejected(key, "not a join record")
            return None
        return float(took) if isinstance(took, _NUM) and not isinstance(took, bool) else None

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
            events = read_jsonl(self.path.parent / rundir.COORDINATOR_LOG)
        except OSError:
            return ""
        gens = {e["gen"]: e.get("reason", "") for e in events if e.get("event") == "generation"}
        return "; ".join(gens[g] for g in range(after + 1, upto + 1) if gens.get(g))


def record_problem(rec: Any, step: int) -> str:
    """Why `rec` is not a replica's record of `step` ("" when it is one): the fields the sink and
    its views read, with their types."""
    if not isinstance(rec, dict):
        return f"not a record ({type(rec).__name__})"
    for name, kind in _FIELDS.items():
        v = rec.get(name)
        if not isinstance(v, kind) or isinstance(v, bool):
            return f"its {name!r} is missing or not {getattr(kind, '__name__', 'a number')}"
    for name, kind in _OPTIONAL.items():
        v = rec.get(name)
        if name in rec and v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
            return f"its {name!r} is not {getattr(kind, '__name__', 'a number')}"
    if rec["step"] != step:
        return f"it is the record of step {rec['step']}"
    if not all(isinstance(m, int) and not isinstance(m, bool) for m in rec["members"]):
        return "its members are not replica ids"
    return ""


class LineFile:
    """Whole lines appended to a file that may refuse them (a full disk, a quota, an I/O error):
    a refused append is reported once (`say`), held, and retried in order every `RETRY_S` (and
    whenever `flush(force=True)`); a partly written attempt is cut back to the last whole line
    first. So every line lands exactly once, whole, in order, once the file system takes it."""

    def __init__(self, path: Path, say: Any) -> None:
        self.path, self.say = path, say
        self.held: list[str] = []
        self.error = ""  # why the last attempt failed ("": it did not)
        self._size: int | None = None  # the file's length after its last whole line
        self._last_try = 0.0

    def append(self, line: str) -> None:
        self.held.append(line)
        self.flush(force=not self.error)

    def flush(self, force: bool = False) -> bool:
        """Try to write what is held; True when nothing is held any more."""
        if not self.held:
            return True
        if not force and time.monotonic() - self._last_try < RETRY_S:
            return False
        self._last_try = time.monotonic()
        data = "".join(self.held).encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            return self._failed(e)
        try:
            if self._size is None:
                self._size = os.fstat(fd).st_size
            elif os.fstat(fd).st_size != self._size:
                os.ftruncate(fd, self._size)  # a failed attempt's partial line
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self._size or 0)
            return self._failed(e)
        finally:
            os.close(fd)
        self._size = (self._size or 0) + len(data)
        if self.error:
            self.say(f"recover: {self.path.name}: wrote the {len(self.held)} line(s) held "
                     f"since the file system refused them ({self.error})")
            log.warning("%s: %d held line(s) written", self.path, len(self.held))
            self.error = ""
        self.held.clear()
        return True

    def _failed(self, e: OSError) -> bool:
        why = e.strerror or str(e)
        if not self.error:
            self.say(f"recover: cannot append to {self.path} ({why}); training goes on, its "
                     f"lines are held and written when it can be written again")
        elif why != self.error:
            log.warning("%s: still refused: %s (%d line(s) held)", self.path, why,
                        len(self.held))
        self.error = why
        return False


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
    """The committed steps' records (`recover.app.rundir.read_jsonl`)."""
    return read_jsonl(path)


def truncate_metrics(path: Path, keep_below_step: int) -> None:
    """Drop lines for steps >= keep_below_step (a resumed run rewrites them)."""
    if not path.exists():
        return
    keep = [r for r in read_metrics(path) if r["step"] < keep_below_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in keep))
