"""Parameters of the cluster simulator, with the published sources of their defaults.

Invariant: a `SimParams` that passed `validate()` describes a simulation that can run: the GPUs
split into whole replicas, every time and cost is finite and non-negative, and the failure source
exists. Every policy (`recover`, `ckpt-restart`, `shrink-batch`) is simulated from the same
`SimParams` and the same failure sequence; only the reaction to a fault differs.

Sources of the defaults (each is an assumption; `recover simulate` prints them all):
- Failure rate: Llama 3 (Dubey et al., 2024, "The Llama 3 Herd of Models", section 3.3.4) reports
  419 unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs. Read as independent
  per-GPU faults, that is a per-GPU MTTF of 16,384 * 54 * 24 / 419 = 50,677 h (a job MTBF of 3.1 h
  at 16,384 GPUs, 99 h at 512 GPUs).
- Checkpoint save: a 70B-parameter model's training state (bf16 weights + fp32 master + Adam
  moments, ~16 B/parameter, ~1.1 TB) written at ~20 GB/s aggregate to a parallel file system takes
  ~1 min; published save costs range from tens of seconds to minutes (CheckFreq, FAST'21; Gemini,
  SOSP'23).
- Restart: tearing the job down and relaunching it (scheduler, process start and imports, rendezvous
  and NCCL init, checkpoint load, warm-up) takes minutes to tens of minutes for large jobs;
  FlashRecovery (2025) reports 150 s on 4,800 accelerators as an optimised result. Default 300 s.
- Detection: 1.0 s, a heartbeat threshold (docs/MEASUREMENTS.md, "Liveness and detection":
  recover sees a crash in milliseconds by connection loss, a hang after --stale-s, 2.0 s). By
  default the same detection time is charged to every policy (generous to ckpt-restart, whose
  hangs are often only seen at the NCCL watchdog timeout, 10 min by default; `restart_detect_s`
  sets its own).
- Rebuild of a communicator generation: a few seconds for NCCL at hundreds of GPUs (milliseconds
  for gloo on CPU: docs/MEASUREMENTS.md, "gloo on CPU"). Default 5 s.
- Shape: 512 GPUs, 8 GPUs per replica (tensor parallel inside an 8-GPU node), 64 replicas, N = 256
  microbatches of one 8,192-token sequence (2.1M tokens per step), 5 s per step with all replicas of
  which 0.5 s is the cross-replica all-reduce. These set the time scale only; results depend on the
  ratios of the costs to the step time and to the time between faults.
- Weak scaling: unless N is given, N = max(256, 4 microbatches per replica x R), so at 512 GPUs
  N = 256 as above and a larger job keeps every replica busy with the same step time (at 100,000
  GPUs a fixed N = 256 would leave 12,244 of 12,500 replicas idle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from recover.errors import ConfigError

#: Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs -> per-GPU MTTF in hours.
LLAMA3_PER_GPU_MTTF_H = 16_384 * 54 * 24 / 419

POLICIES = ("recover", "ckpt-restart", "shrink-batch")

#: N when neither `microbatches` is given nor `microbatches_per_replica * replicas` is larger.
DEFAULT_MICROBATCHES = 256


@dataclass
class SimParams:
    """One simulated job. Times in seconds unless the name says `_h` (hours)."""

    gpus: int = 512
    gpus_per_replica: int = 8  # a replica is lost when any of its GPUs fails
    per_gpu_mttf_h: float | None = LLAMA3_PER_GPU_MTTF_H  # None: no random failures
    failure_trace: str | None = None  # CSV/JSON of failure times in hours (see `faults.load_trace`)
    fault_times_h: list[float] | None = None  # explicit failure times (scenarios); beats the trace
    fault_steps: list[int] | None = None  # kill one replica during each listed step (bench runs)
    fault_offset_frac: float = 0.5  # where in the step's compute phase a step fault strikes
    step_time_s: float = 5.0  # failure-free step with all replicas (compute + all-reduce)
    microbatch_time_s: float | None = None  # None: (step_time_s - allreduce_s) / ceil(N / R)
    # Measured failure-free step time with r replicas (N spread over r), where it is not simply
    # ceil(N / r) microbatches (e.g. processes sharing CPU cores run faster when fewer are left).
    step_time_by_replicas: dict[int, float] | None = None
    # N, constant per step for recover and ckpt-restart; None: weak scaling (`n_microbatches`).
    microbatches: int | None = None
    microbatches_per_replica: int = 4  # weak scaling: N >= this many per replica when N is None
    tokens_per_microbatch: int = 8192
    ckpt_interval_steps: int | None = None  # None: Young-Daly from the job's MTBF
    ckpt_cost_s: float = 60.0
    restart_cost_s: float = 300.0
    detect_s: float = 1.0
    restart_detect_s: float | None = None  # ckpt-restart's detection; None: detect_s
    rebuild_s: float = 5.0
    allreduce_s: float = 0.5
    # Failure-free control-plane time per step (commit agreement) of recover and shrink-batch;
    # 0 by default (the paper scenario); the scale scenario charges the measured curve's.
    control_plane_s: float = 0.0
    spares: int = 0  # spare replicas (of gpus_per_replica GPUs each), allocated from the start
    replace_delay_s: float = 600.0  # a spare's time from a loss to joining (recover, shrink-batch)
    total_steps: int | None = 10_000  # committed steps to reach; None: run until the budget
    budget_h: float | None = None  # wall-clock limit in hours; None: until total_steps
    min_replicas: int = 1  # below this the job stops
    startup_s: float = 0.0  # one-off launch time added to every policy's wall time
    seed: int = 0

    @property
    def replicas(self) -> int:
        return self.gpus // self.gpus_per_replica

    @property
    def n_microbatches(self) -> int:
        """N: `microbatches` if given, else max(256, microbatches_per_replica * replicas)."""
        if self.microbatches is not None:
            return self.microbatches
        return max(DEFAULT_MICROBATCHES, self.microbatches_per_replica * self.replicas)

    @property
    def mb_time_s(self) -> float:
        """Time of one microbatch (forward + backward) on one replica."""
        if self.microbatch_time_s is not None:
            return self.microbatch_time_s
        per_replica = math.ceil(self.n_microbatches / self.replicas)
        return (self.step_time_s - self.allreduce_s) / per_replica

    def mb_time(self, r: int) -> float:
        """Time of one microbatch on one replica while `r` replicas run."""
        t = (self.step_time_by_replicas or {}).get(r)
        if t is None:
            return self.mb_time_s
        return (t - self.allreduce_s) / math.ceil(self.n_microbatches / r)

    def step_time(self, max_quota: int, r: int | None = None) -> float:
        """Step time when the busiest of `r` replicas (default R) computes `max_quota` microbatches.

        `step_time_s` with R replicas (ceil(N / R) each), or the measured time with r replicas, plus
        or minus whole microbatches for a busier or idler busiest replica.
        """
        table = self.step_time_by_replicas or {}
        if r is not None and r in table:
            return table[r] + (max_quota - math.ceil(self.n_microbatches / r)) * self.mb_time(r)
        base = math.ceil(self.n_microbatches / self.replicas)
        return self.step_time_s + (max_quota - base) * self.mb_time_s

    @property
    def budget_s(self) -> float:
        return math.inf if self.budget_h is None else self.budget_h * 3600.0

    def validate(self) -> SimParams:
        """Raise `ConfigError` (one line) for anything that cannot be simulated; return self."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if not math.isfinite(v) or v < 0:
                raise ConfigError(
                    f"{f.name.replace('_', '-')} must be a finite value >= 0, got {v}"
                )
        for name in (
            "gpus",
            "gpus_per_replica",
            "microbatches",
            "microbatches_per_replica",
            "tokens_per_microbatch",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1")
        if self.gpus % self.gpus_per_replica:
            raise ConfigError(
                f"gpus ({self.gpus}) is not divisible by gpus-per-replica ({self.gpus_per_replica})"
            )
        if self.step_time_s <= 0:
            raise ConfigError("step-time-s must be > 0")
        if self.allreduce_s >= self.step_time_s:
            raise ConfigError("allreduce-s must be smaller than step-time-s")
        if self.per_gpu_mttf_h is not None and self.per_gpu_mttf_h <= 0:
            raise ConfigError("per-gpu-mttf-h must be > 0 (omit it for no random failures)")
        if self.ckpt_interval_steps is not None and self.ckpt_interval_steps < 1:
            raise ConfigError("ckpt-interval-steps must be >= 1")
        if self.total_steps is None and self.budget_h is None:
            raise ConfigError("give total-steps or budget-h (the simulation needs an end)")
        if self.min_replicas < 1 or self.min_replicas > self.replicas:
            raise ConfigError(f"min-replicas must be in 1..{self.replicas}")
        if not 0.0 <= self.fault_offset_frac <= 1.0:
            raise ConfigError("fault-offset-frac must be within 0..1")
        if self.failure_trace is not None and not Path(self.failure_trace).is_file():
            raise ConfigError(f"failure trace not found: {self.failure_trace}")
        for r, t in (self.step_time_by_replicas or {}).items():
            if not (isinstance(r, int) and 1 <= r <= self.replicas):
                raise ConfigError(f"step time by replicas: {r!r} is not a replica count")
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t > self.allreduce_s):
                raise ConfigError(f"step time with {r} replicas must exceed allreduce-s, got {t!r}")
        for t in self.fault_times_h or []:
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                raise ConfigError(f"fault times must be finite hours >= 0, got {t!r}")
        for s in self.fault_steps or []:
            if not isinstance(s, int) or isinstance(s, bool) or s < 0:
                raise ConfigError(f"fault steps must be integers >= 0, got {s!r}")
        return self


def young_daly_interval_s(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Young-Daly optimal time between checkpoints: sqrt(2 * C * MTBF) (Young 1974, Daly 2006)."""
    return math.sqrt(2.0 * ckpt_cost_s * mtbf_s)


def young_daly_steps(ckpt_cost_s: float, mtbf_s: float, step_time_s: float) -> int:
    """Young-Daly interval in whole steps (at least 1): K * step_time = sqrt(2 * C * MTBF)."""
    if not math.isfinite(mtbf_s):
        return 1_000_000_000  # no faults expected: never checkpoint (inside any horizon)
    return max(1, round(young_daly_interval_s(ckpt_cost_s, mtbf_s) / step_time_s))
