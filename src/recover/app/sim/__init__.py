"""`recover.app.sim`: discrete-event simulator of LLM pre-training on a GPU cluster under failures.

Invariant: the three policies (`recover`, `ckpt-restart`, `shrink-batch`) are simulated from the
same `SimParams` against the same failure sequence, and every figure the simulator reports is
computed from stated assumptions (printed by `recover simulate`), never typed in.

Modules: `params` (SimParams, defaults and their sources, Young-Daly), `faults` (failure sequences,
trace format), `job` (the event core: `Job`, `replica_quotas`), `policies` (the three event
loops), `engine` (`simulate`, the runner registry; imports run engine -> policies -> job),
`results` (metrics), `scenario` (the paper scenario), `scale` (the scale scenario: ETTR by job
size) with `curve` (recover's measured scale curve, `data/scale_curve.json`, and its fits) and
`scale_report`, `calibrate` (bench.json schema, `predict_wall_times`), `sensitivity`, `report`,
`cli`.
"""

from recover.app.sim.calibrate import calib_params, load_calibration, predict_wall_times
from recover.app.sim.engine import simulate
from recover.app.sim.faults import FaultSchedule, build_schedule
from recover.app.sim.params import (
    LLAMA3_PER_GPU_MTTF_H,
    POLICIES,
    SimParams,
    young_daly_interval_s,
    young_daly_steps,
)
from recover.app.sim.results import PolicyResult, extra_tokens_pct_at, throughput_ratio

__all__ = [
    "LLAMA3_PER_GPU_MTTF_H",
    "POLICIES",
    "FaultSchedule",
    "PolicyResult",
    "SimParams",
    "build_schedule",
    "calib_params",
    "extra_tokens_pct_at",
    "load_calibration",
    "predict_wall_times",
    "simulate",
    "throughput_ratio",
    "young_daly_interval_s",
    "young_daly_steps",
]
