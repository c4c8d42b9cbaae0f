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


# SimParams field, its value's kind, and its help: one row a flag (an indented line goes on
# with the help above it). Every field of SimParams has a flag (a test checks it). Kinds: a number
# >= 0 (int, float), or also 'none' (|none); comma-separated lists (ints, floats); a step-time
# table (R:S,...); a path (str).
_TABLE = """
gpus                      int         GPUs in the job (default 512)
gpus_per_replica          int         GPUs per replica, the unit of failure (default 8)
per_gpu_mttf_h            float|none  per-GPU mean time to failure in hours, 'none' for no random
                                      failures (default 50,677 h: Llama 3, 419 interruptions in 54
                                      days on 16,384 GPUs)
failure_trace             str         CSV/JSON file of failure times in hours (format:
                                      recover.app.sim.faults)
fault_times_h             floats      comma-separated failure times in hours
fault_steps               ints        comma-separated steps during which one replica is killed
fault_offset_frac         float       where in a step's compute a step fault lands (0.5)
step_time_s               float       failure-free step time with all replicas (default 5 s)
microbatch_time_s         float|none  one microbatch on one replica (default derived)
microbatches              int|none    N, microbatches per step (default: 256, or
                                      microbatches-per-replica x replicas when larger: weak scaling)
microbatches_per_replica  int         weak scaling: N is at least this many per replica unless
                                      --microbatches is given (4)
tokens_per_microbatch     int         tokens per microbatch (default 8192)
ckpt_interval_steps       int|none    ckpt-restart's interval, 'young-daly' (default)
ckpt_cost_s               float       one checkpoint save (default 60 s)
restart_cost_s            float       ckpt-restart's restart: launch, rendezvous, load (300 s)
detect_s                  float       failure detection (default 1 s: heartbeat threshold)
restart_detect_s          float|none  ckpt-restart's detection (default detect-s; a hang is seen at
                                      the NCCL timeout, 600 s by default)
step_time_by_replicas     R:S,...     measured step times by replica count, '4:0.2,3:0.18'
rebuild_s                 float       new communicator generation, recover/shrink-batch (5 s)
allreduce_s               float       cross-replica all-reduce inside the step time (0.5 s)
control_plane_s           float       per-step agreement after the all-reduce, recover and
                                      shrink-batch (default 0)
spares                    int         spare replicas allocated from the start (default 0)
replace_delay_s           float       loss -> spare joined, recover/shrink-batch (600 s)
total_steps               int|none    committed steps to reach, 'none' = until the budget
budget_h                  float|none  wall-clock budget in hours
min_replicas              int         stop below this many replicas (default 1)
startup_s                 float       one-off launch time paid by every policy (default 0)
seed                      int         seed of the failure draws (default 0)
"""
_KINDS: dict[str, Callable[[str], Any]] = {
    "int": non_negative(int), "float": non_negative(float),
    "int|none": non_negative(int, True), "float|none": non_negative(float, True),
    "ints": _list(int), "floats": _list(float), "R:S,...": _steps_table, "str": str}
#: SimParams field -> (parser, help).
FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    name: (_KINDS[kind], " ".join(hlp.split()))
    for name, kind, hlp in (row.split(maxsplit=2)
                            for row in _TABLE.strip().replace("\n" + " " * 38, " ").splitlines())}


#: Fields the paper scenario sets itself (giving them with --scenario paper is an error).
SCENARIO_OWNS = (
    "per_gpu_mttf_h",
    "failure_trace",
    "fault_times_h",
    "fault_steps",
    "total_steps",
    "budget_h",
)
