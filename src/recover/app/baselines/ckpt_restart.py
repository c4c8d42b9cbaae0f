"""The checkpoint-and-restart baseline: the real trainer, torn down and relaunched on every fault.

Invariant: the job checkpoints (DCP) every K steps, K from the Young-Daly rule with the measured
checkpoint cost and the schedule's mean time between faults (the baseline at its best); when any
replica dies the whole job is ended (`AbortOnLoss`, the baseline's own policy, which it hands the
launcher as `launch(..., watch=AbortOnLoss)`; as torchrun's agent does) and it is relaunched
`--resume` from the latest checkpoint (or from scratch if there is none yet) with the survivors,
renumbered 0..r-1; N stays constant, so its trajectory is the failure-free one. A fault fires once:
a replayed step does not kill again. The final metrics.jsonl holds one line per committed step;
work redone after a rollback is counted as lost.
"""

from __future__ import annotations

import math
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from recover.app import rundir
from recover.app.baselines.runs import Attempt, SystemRun, config_for
from recover.app.baselines.schedule import remap
from recover.app.config import RunConfig
from recover.app.faults import Fault
from recover.app.rundir import read_jsonl
from recover.app.runtoken import run_token
from recover.app.sim.params import young_daly_steps
from recover.app.train.checkpoint.dcp import latest_checkpoint
from recover.app.train.launch import launch
from recover.app.train.metrics import read_metrics
from recover.errors import RecoverError
from recover.procs import Process, stop_all


class AbortOnLoss:
    """The baseline's reaction to a loss (a `recover.app.train.launch.Watch`): once a replica
    exits abnormally, end every replica by PID, as torchrun's agent does."""

    def __init__(self, workers: dict[int, Process], poll_s: float = 0.005) -> None:
        self.workers, self.poll_s = workers, poll_s
        self.lost: list[int] = []
        self.t = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recover-abort", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            bad = [r for r, p in self.workers.items() if p.poll() not in (None, 0)]
            if bad:
                self.t, self.lost = time.time(), bad
                # SIGKILL: what torchrun's SIGTERM did to a replica before a replica's SIGTERM
                # meant "preempted: leave at the next step boundary".
                stop_all(list(self.workers.values()), sig=signal.SIGKILL)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def young_daly_k(ckpt_cost_s: float, step_time_s: float, steps: int, kills: int) -> int:
    """Checkpoint interval in steps: K * step = sqrt(2 * C * MTBF), MTBF = run time / faults."""
    mtbf = steps * step_time_s / kills if kills else math.inf
    return max(1, min(steps, young_daly_steps(ckpt_cost_s, mtbf, step_time_s)))


def run_ckpt_restart(base: RunConfig, out: Path, faults: list[Fault], k: int) -> SystemRun:
    """Run to the last step through every fault of `faults`; one launch per fault plus one."""
    alive = list(range(base.layout.replicas))
    pending = list(faults)
    run = SystemRun("ckpt-restart", config_for(base, out, run={"ckpt_every": k}))
    run.extra["ckpt_every"] = k
    resume, start = False, 0
    for _ in range(len(faults) + 1):
        cfg = config_for(base, out, layout={"replicas": len(alive)},
                         ft={"faults": [str(f) for f in remap(pending, alive)],
                             "min_replicas": 1, "policy": "recover"},
                         run={"ckpt_every": k, "resume": resume})
        t = time.time()
        res = launch(cfg, quiet=True, watch=AbortOnLoss)
        run.attempts.append(Attempt(list(alive), start, t, res))
        if res.ok:
            run.records = read_metrics(out / rundir.METRICS)
            run.extra["restarts"] = restart_costs(run)
            return run
        if not res.aborted:
            raise RecoverError(f"bench: ckpt-restart failed: {res.message}")
        dead = {alive[r] for r in res.aborted}
        alive = [a for a in alive if a not in dead]
        pending = [f for f in pending if f.replica not in dead]  # a fired fault does not re-fire
        if not alive:
            raise RecoverError("bench: ckpt-restart lost every replica")
        ckpt = latest_checkpoint(out / rundir.CKPT, run_token(out))
        resume = ckpt is not None
        if not resume:  # no checkpoint yet: the relaunch starts from step 0, as a fresh job
            (out / rundir.METRICS).unlink(missing_ok=True)
            shutil.rmtree(out / rundir.CKPT, ignore_errors=True)
        start = int(ckpt.name.split("_")[1]) if ckpt is not None else 0
    raise RecoverError(f"bench: ckpt-restart aborted more often than the {len(faults)} faults")


def restart_costs(run: SystemRun) -> list[dict[str, Any]]:
    """Per restart: detection, relaunch (-> first step again), redone steps and their time."""
    out = []
    losses = run.loss_times()
    log = Path(run.cfg.run.out) / rundir.COORDINATOR_LOG
    events = read_jsonl(log)
    for i in range(1, len(run.attempts)):
        prev, cur = run.attempts[i - 1], run.attempts[i]
        times = cur.commit_times()
        reached = prev.start_step + len(prev.result.records)  # steps committed before the fault
        redone = max(0, reached - cur.start_step)
        t_fault = run.t0 + losses[i - 1] if i - 1 < len(losses) else prev.result.t_abort
        first = times[0][1] if times else math.nan
        mine = [e for e in events if cur.t_call <= e["time"] <= first]
        up = min((e["time"] for e in mine if e["event"] == "start"), default=math.nan)
        joined = max((e["time"] for e in mine if e["event"] == "hello"), default=math.nan)
        gen0 = min((e["time"] for e in mine if e["event"] == "generation"), default=math.nan)
        back = next((t for s, t in times if s + 1 >= reached), math.nan)
        out.append({
            "at_step": reached, "from_checkpoint": cur.start_step, "replicas": len(cur.replicas),
            "detect_s": prev.result.t_abort - t_fault,
            "first_commit_s": first - prev.result.t_abort,  # teardown .. first step committed
            # ... of which: teardown and relaunch up to the coordinator (process start, imports),
            # the replicas up (process start, imports, data, checkpoint load), the rendezvous
            # (membership and first generation), and the first step itself.
            "teardown_to_coordinator_s": up - prev.result.t_abort,
            "replicas_started_s": joined - up, "rendezvous_s": gen0 - joined,
            "first_step_s": first - gen0,
            "redone_steps": redone, "caught_up_s": back - t_fault if redone else 0.0,
            "total_s": back - t_fault if redone else first - t_fault,
        })
    return out
