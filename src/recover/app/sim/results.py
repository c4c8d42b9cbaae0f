"""What one simulated policy produced, and the comparisons between policies.

Invariant: `committed_mb` counts only microbatches on the policy's final trajectory (work rolled
back by a restart or discarded with a faulted step is not in it); `processed_mb` counts every
microbatch computed. GPU-hours charge every allocated, healthy GPU (active, restarting or spare)
from the start until the job ends; a failed replica's GPUs are released at the failure.

Definitions used by `recover simulate`'s last lines:
- effective throughput: committed microbatches (times tokens per microbatch) per wall-clock second.
- `throughput_ratio`: recover's effective throughput over ckpt-restart's, both measured over the
  window from the first replica loss to the end of the run ("after successive failures"): progress
  at the end minus progress just before the first loss, over the window's length. Work that
  ckpt-restart had done before the loss but then rolled back therefore counts against it.
- `extra_tokens_pct_at(g)`: at the moment each policy has consumed `g` GPU-hours, the percentage
  more trajectory tokens (committed so far) recover holds than ckpt-restart: 100 * (rec / ckpt - 1).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class PolicyResult:
    """One policy's run. `series` rows: (wall_s, gpu_hours, committed_tokens, processed_tokens)."""

    policy: str
    wall_s: float
    steps: int  # committed steps
    committed_mb: int
    processed_mb: int
    gpu_hours: float
    tokens_per_microbatch: int
    microbatches: int  # N, the failure-free batch
    replica_losses: int = 0  # active replicas lost during this policy's run
    restarts: int = 0
    checkpoints: int = 0
    discarded_steps: int = 0  # shrink-batch: faulted steps thrown away
    min_batch_mb: int = 0  # smallest global batch of a committed step
    finished: bool = False  # reached total_steps
    stop_reason: str = ""
    series: list[tuple[float, float, float, float]] = field(default_factory=list)
    fault_times_s: list[float] = field(default_factory=list)
    gpus_per_replica: int = 1
    n_slots: int = 1
    deaths_s: list[float] = field(default_factory=list)

    @property
    def lost_mb(self) -> int:
        return self.processed_mb - self.committed_mb

    @property
    def committed_tokens(self) -> int:
        return self.committed_mb * self.tokens_per_microbatch

    @property
    def throughput_mb_s(self) -> float:
        """Effective throughput: committed microbatches per wall-clock second."""
        return self.committed_mb / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_batch_frac(self) -> float:
        """Mean global batch of the committed steps as a fraction of N (1.0 = batch preserved)."""
        return self.committed_mb / (self.steps * self.microbatches) if self.steps else 1.0

    def gpu_hours_at(self, t: float) -> float:
        """GPU-hours consumed by wall time `t` (exact, from the replica deaths)."""
        t = min(t, self.wall_s)
        lost = sum(t - d for d in self.deaths_s if d < t)
        return self.gpus_per_replica * (self.n_slots * t - lost) / 3600.0

    def time_at_gpu_hours(self, g: float) -> float:
        """The wall time when `g` GPU-hours have been consumed (nan if the run ends before)."""
        if g > self.gpu_hours_at(self.wall_s) + 1e-9:
            return math.nan
        lo, hi = 0.0, self.wall_s
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.gpu_hours_at(mid) < g else (lo, mid)
        return hi

    def progress_at(self, t: float, before: bool = False) -> float:
        """Committed tokens at wall time `t` (`before`: just before `t`, excluding a drop at `t`).

        Between two recorded points progress grows linearly if it grew (fault-free stretches are
        recorded in bulk) and holds until the later point if it fell (a rollback happens there).
        """
        times = [row[0] for row in self.series]
        i = bisect.bisect_left(times, t) if before else bisect.bisect_right(times, t)
        if i == 0:
            return 0.0
        t0, c0 = self.series[i - 1][0], self.series[i - 1][2]
        if i == len(self.series):
            return c0
        t1, c1 = self.series[i][0], self.series[i][2]
        if c1 <= c0 or t1 <= t0:
            return c0
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def window_throughput(r: PolicyResult, t0: float, t1: float) -> float:
    """Committed tokens per second between `t0` (just before it) and `t1`."""
    if t1 <= t0:
        return math.nan
    return (r.progress_at(t1) - r.progress_at(t0, before=True)) / (t1 - t0)


def throughput_ratio(rec: PolicyResult, ckpt: PolicyResult) -> float:
    """recover / ckpt-restart effective throughput from the first replica loss to the run's end."""
    firsts = rec.fault_times_s[:1] + ckpt.fault_times_s[:1]
    t0 = min(firsts) if firsts else 0.0
    t1 = min(rec.wall_s, ckpt.wall_s)
    a, b = window_throughput(rec, t0, t1), window_throughput(ckpt, t0, t1)
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b if b > 0 else math.inf


def extra_tokens_pct_at(rec: PolicyResult, ckpt: PolicyResult, gpu_hours: float) -> float:
    """Percent more committed tokens recover holds than ckpt-restart at `gpu_hours` consumed."""
    ta, tb = rec.time_at_gpu_hours(gpu_hours), ckpt.time_at_gpu_hours(gpu_hours)
    if math.isnan(ta) or math.isnan(tb):
        return math.nan
    a, b = rec.progress_at(ta), ckpt.progress_at(tb)
    return 100.0 * (a / b - 1.0) if b > 0 else math.inf
