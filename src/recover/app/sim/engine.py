"""`simulate()`: run the named policies, each from a fresh `Job`, against one failure sequence.

Invariant: every policy of one call sees the same `SimParams` and the same `FaultSchedule` (built
once here unless the caller passes one), so their results differ only by how each policy reacts.
The runner registry lives here, above `policies` and `job` in the import order (engine ->
policies -> job), so no module of the simulator imports one that imports it back.
"""

from __future__ import annotations

from collections.abc import Callable

from recover.app.sim.faults import FaultSchedule, build_schedule
from recover.app.sim.job import Job
from recover.app.sim.params import POLICIES, SimParams
from recover.app.sim.policies import run_ckpt_restart, run_recover, run_shrink_batch
from recover.app.sim.results import PolicyResult

RUNNERS: dict[str, Callable[[Job], PolicyResult]] = {
    "recover": run_recover,
    "ckpt-restart": run_ckpt_restart,
    "shrink-batch": run_shrink_batch,
}


def simulate(
    p: SimParams, policies: tuple[str, ...] = POLICIES, schedule: FaultSchedule | None = None
) -> dict[str, PolicyResult]:
    """Run each policy against the same failure sequence; return their results by name."""
    p.validate()
    sched = schedule if schedule is not None else build_schedule(p)
    out = {}
    for name in policies:
        if name not in RUNNERS:
            raise ValueError(f"unknown policy {name!r}")
        out[name] = RUNNERS[name](Job(p, sched, name))
    return out
