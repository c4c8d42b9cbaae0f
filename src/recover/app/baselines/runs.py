"""One system's bench run, as measured: launches, committed records, progress over wall time.

Invariant: every time here is wall-clock `time.time()` of this machine. A system's one-off launch
(`startup_s`: data preparation, process start, imports, rendezvous, up to its first step) is kept
apart from its training wall time (`wall_s`: the first step's start -> the last step's commit),
which includes everything a fault costs, ckpt-restart's relaunches included. `records` is the
system's final metrics.jsonl (one line per committed step); `progress` is what was committed at
each moment since the first step, rollbacks included.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from recover.app import rundir
from recover.app.config import RunConfig
from recover.app.faults import Fault
from recover.app.rundir import read_jsonl
from recover.app.train.checkpoint.dcp import save_checkpoint
from recover.app.train.launch import RunResult, launch
from recover.app.train.metrics import read_metrics
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer
from recover.control.membership import LEFT_CLEANLY
from recover.errors import RecoverError


@dataclass
class Attempt:
    """One launch of a system: its replicas (original ids), first step and result."""

    replicas: list[int]
    start_step: int
    t_call: float  # time.time() just before launch()
    result: RunResult

    def commit_times(self) -> list[tuple[int, float]]:
        """(step, absolute commit time) of every record this launch committed."""
        return [(r["step"], self.result.t_start + r["time_s"]) for r in self.result.records]


@dataclass
class SystemRun:
    name: str
    cfg: RunConfig
    attempts: list[Attempt] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def t_call(self) -> float:
        return self.attempts[0].t_call

    @property
    def t0(self) -> float:
        """When the job's first step started (its publisher's clock, after its own startup)."""
        first = self.attempts[0].result
        rec = first.records[0]
        return first.t_start + rec["time_s"] - rec["step_time_s"]

    @property
    def startup_s(self) -> float:
        return self.t0 - self.t_call

    def commit_abs(self) -> dict[int, float]:
        """Absolute commit time of each step of the final trajectory (its last commit)."""
        out: dict[int, float] = {}
        for a in self.attempts:
            out.update(a.commit_times())
        return {r["step"]: out[r["step"]] for r in self.records}

    @property
    def wall_s(self) -> float:
        """The first step's start -> the last step's commit."""
        return max(self.commit_abs().values()) - self.t0

    def progress(self) -> list[tuple[float, int]]:
        """(seconds since t0, committed steps) after every commit and every rollback."""
        pts = [(-self.startup_s, 0), (0.0, 0)]
        for i, a in enumerate(self.attempts):
            if i > 0:  # the relaunch starts from its checkpoint: later work is rolled back
                pts.append((self.attempts[i - 1].result.t_abort - self.t0, a.start_step))
            pts += [(t - self.t0, s + 1) for s, t in a.commit_times()]
        return pts

    def loss_times(self) -> list[float]:
        """Seconds since t0 at which a replica was lost (the coordinator's evidence of it)."""
        events = _lost_evidence(Path(self.cfg.run.out) / rundir.COORDINATOR_LOG)
        out = []
        for i, a in enumerate(self.attempts):
            stop = (self.attempts[i + 1].t_call if i + 1 < len(self.attempts) else float("inf"))
            mine = [t for t in events if a.t_call <= t < stop]
            # A torn-down job's survivors also close their sockets: only its first loss is a fault.
            out += mine[:1] if a.result.aborted else mine
        return [t - self.t0 for t in out]


def _lost_evidence(log: Path) -> list[float]:
    """Times of the first loss evidence per replica and job in a coordinator log."""
    if not log.exists():
        return []
    out, seen = [], set()
    for e in read_jsonl(log):
        if e.get("event") == "start":
            seen = set()
        elif (e.get("event") == "evidence" and e.get("replica") is not None
              and not str(e.get("reason", "")).startswith(LEFT_CLEANLY)
              and e["replica"] not in seen):
            seen.add(e["replica"])
            out.append(float(e["time"]))
    return out


def config_for(base: RunConfig, out: Path, **sections: dict[str, Any]) -> RunConfig:
    """A copy of `base` writing to `out`, with `sections` changed (see `RunConfig.replace`)."""
    run = {"out": str(out), **sections.pop("run", {})}
    return base.replace(run=run, **sections)


def run_once(name: str, base: RunConfig, out: Path, faults: list[Fault],
             policy: str = "recover") -> SystemRun:
    """A system that survives faults in place (recover, shrink-batch) or a failure-free run."""
    cfg = config_for(base, out, ft={"faults": [str(f) for f in faults], "policy": policy})
    run = SystemRun(name, cfg)
    t = time.time()
    res = launch(cfg, quiet=True)
    run.attempts.append(Attempt(list(range(cfg.layout.replicas)), 0, t, res))
    if not res.ok:
        raise RecoverError(f"bench: {name} failed: {res.message}")
    run.records = read_metrics(out / rundir.METRICS)
    return run


def measure_ckpt_cost(base: RunConfig, repeats: int = 3) -> float:
    """Median seconds of one blocking DCP save of this model and its AdamW state (in-process)."""
    torch.set_num_threads(1)
    model = build_model(base.model, base.run.seed)
    opt = build_optimizer(model, base)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW state exists, as in every checkpoint after step 0
    root = Path(tempfile.mkdtemp(prefix="recover-ckpt-cost-"))
    try:
        times = []
        for i in range(repeats + 1):
            t = time.perf_counter()
            save_checkpoint(root, i + 1, model, opt, {"next_microbatch_id": 0},
                            key=b"cost-only")  # a throwaway checkpoint: any key will do
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])  # the first save pays one-off imports
    finally:
        shutil.rmtree(root, ignore_errors=True)


def dump_runs(path: Path, runs: list[SystemRun]) -> None:
    """Every launch's raw timings and records (`rundir.BENCH_RUNS`), to recompute figures."""
    data = [{"name": s.name, "config": asdict(s.cfg), "extra": s.extra,
             "records": s.records,
             "attempts": [{"replicas": a.replicas, "start_step": a.start_step, "t_call": a.t_call,
                           "t_start": a.result.t_start, "t_abort": a.result.t_abort,
                           "aborted": a.result.aborted, "records": a.result.records}
                          for a in s.attempts]} for s in runs]
    path.write_text(json.dumps(data) + "\n")
