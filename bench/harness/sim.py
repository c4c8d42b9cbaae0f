"""A calibration record for the simulator's tests, in the schema `recover bench` writes.

Invariant: one record, at the debug preset's scale (4 replicas, N = 8, 40 steps, costs of the
order this machine measures), that every simulator test starts from and changes only in what the
test is about.
"""

from __future__ import annotations


def calib(**over: object) -> dict:
    """A bench.json record (recover.app.sim.calibrate's schema), with `over` replacing fields."""
    base = {
        "replicas": 4,
        "microbatches": 8,
        "steps": 40,
        "step_time_s": 0.2,
        "allreduce_s": 0.02,
        "ckpt_cost_s": 0.3,
        "ckpt_every": 10,
        "restart_cost_s": 6.0,
        "detect_s": 1.0,
        "rebuild_s": 0.02,
        "fault_steps": [],
        "startup_s": 4.5,
    }
    base.update(over)
    return base
