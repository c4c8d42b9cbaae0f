"""Command-line flags of `recover simulate`: one per `SimParams` field, with its parser and help.

Invariant: every field of `SimParams` has exactly one flag here (a test checks it), and every parser
rejects negative or non-finite numbers with an `argparse.ArgumentTypeError` (one readable line).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def non_negative(kind: type, allow_none: bool = False) -> Callable[[str], Any]:
    def parse(s: str) -> Any:
        if allow_none and s.lower() in ("none", "off", "auto", "young-daly"):
            return None
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {s!r}") from None
        if not math.isfinite(v) or v < 0:
            raise argparse.ArgumentTypeError(f"must be a finite value >= 0, got {s!r}")
        return v

    return parse


def _list(kind: type) -> Callable[[str], list[Any]]:
    def parse(s: str) -> list[Any]:
        return [non_negative(kind)(x) for x in s.split(",") if x.strip()]

    return parse


def _steps_table(s: str) -> dict[int, float]:
    try:
        pairs = [x.split(":") for x in s.split(",") if x.strip()]
        return {int(r): non_negative(float)(t) for r, t in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R:SECONDS,..., got {s!r}") from None


#: SimParams field -> (parser, help). Every field of SimParams has a flag.
FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "gpus": (non_negative(int), "GPUs in the job (default 512)"),
    "gpus_per_replica": (non_negative(int), "GPUs per replica, the unit of failure (default 8)"),
    "per_gpu_mttf_h": (
        non_negative(float, True),
        "per-GPU mean time to failure in hours, 'none' for no "
        "random failures (default 50,677 h: Llama 3, 419 interruptions in 54 days "
        "on 16,384 GPUs)",
    ),
    "failure_trace": (str, "CSV/JSON file of failure times in hours (format: recover.sim.faults)"),
    "fault_times_h": (_list(float), "comma-separated failure times in hours"),
    "fault_steps": (_list(int), "comma-separated steps during which one replica is killed"),
    "fault_offset_frac": (
        non_negative(float),
        "where in a step's compute a step fault lands (0.5)",
    ),
    "step_time_s": (non_negative(float), "failure-free step time with all replicas (default 5 s)"),
    "microbatch_time_s": (
        non_negative(float, True),
        "one microbatch on one replica (default derived)",
    ),
    "microbatches": (
        non_negative(int, True),
        "N, microbatches per step (default: 256, or microbatches-per-replica x replicas when "
        "larger: weak scaling)",
    ),
    "microbatches_per_replica": (
        non_negative(int),
        "weak scaling: N is at least this many per replica unless --microbatches is given (4)",
    ),
    "tokens_per_microbatch": (non_negative(int), "tokens per microbatch (default 8192)"),
    "ckpt_interval_steps": (
        non_negative(int, True),
        "ckpt-restart's interval, 'young-daly' (default)",
    ),
    "ckpt_cost_s": (non_negative(float), "one checkpoint save (default 60 s)"),
    "restart_cost_s": (
        non_negative(float),
        "ckpt-restart's restart: launch, rendezvous, load (300 s)",
    ),
    "detect_s": (non_negative(float), "failure detection (default 1 s: heartbeat threshold)"),
    "restart_detect_s": (
        non_negative(float, True),
        "ckpt-restart's detection (default detect-s; a hang "
        "is seen at the NCCL timeout, 600 s by default)",
    ),
    "step_time_by_replicas": (_steps_table, "measured step times by replica count, '4:0.2,3:0.18'"),
    "rebuild_s": (non_negative(float), "new communicator generation, recover/shrink-batch (5 s)"),
    "allreduce_s": (non_negative(float), "cross-replica all-reduce inside the step time (0.5 s)"),
    "control_plane_s": (
        non_negative(float),
        "per-step agreement after the all-reduce, recover and shrink-batch (default 0)",
    ),
    "spares": (non_negative(int), "spare replicas allocated from the start (default 0)"),
    "replace_delay_s": (non_negative(float), "loss -> spare joined, recover/shrink-batch (600 s)"),
    "total_steps": (non_negative(int, True), "committed steps to reach, 'none' = until the budget"),
    "budget_h": (non_negative(float, True), "wall-clock budget in hours"),
    "min_replicas": (non_negative(int), "stop below this many replicas (default 1)"),
    "startup_s": (non_negative(float), "one-off launch time paid by every policy (default 0)"),
    "seed": (non_negative(int), "seed of the failure draws (default 0)"),
}


#: Fields the paper scenario sets itself (giving them with --scenario paper is an error).
SCENARIO_OWNS = (
    "per_gpu_mttf_h",
    "failure_trace",
    "fault_times_h",
    "fault_steps",
    "total_steps",
    "budget_h",
)
