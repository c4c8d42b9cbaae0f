"""What this machine adds to a CPU figure when more processes share its cores, for `bench/scale.py`.

Invariant: the figure is one process's CPU time (its own thread's clock) for one fixed pass of
work, the same instructions at every process count: the median over the rounds of a process, then
the median over the processes (`bench/scale.py` alternates the two counts, twice each). The
processes are forked, each ends by itself after `rounds` rounds (joined with a timeout, then
ended by PID), and every wait is bounded.

Why: `recovery_cpu_ratio` compares a survivor's CPU at 64 ranks with its CPU at 4, with every rank
a process on this machine's few cores. Work that does not grow with R still costs more CPU among
64 busy processes: between two of its wake-ups a process's caches are refilled by the others,
and it then runs its pass cold. The pass here is of the step protocol's kind (a few small tensors
and `record_function` scopes, a dict and a JSON line over 64 entries), run once per wake-up like
a step's hooks, with a private buffer touched after it as a rank touches its own memory; the
ratio of its CPU at the largest process count over the smallest is how much of the recovery's
ratio the machine makes, measured beside it (docs/MEASUREMENTS.md, "The control plane at scale").
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from torch.autograd.profiler import record_function

SLEEP_S = 0.01  # between passes, as a rank waits a microbatch's compute between its hooks
BUFFER_MB = 4  # each process's own memory, touched after every pass
JOIN_S = 60.0


def _one_pass(keep: dict[str, Any]) -> None:
    with record_function("same_work.a"):
        t = torch.tensor([1.0, 2.0, 3.0])
        t.add_(1.0)
        values = t.tolist()
    table = {str(i): i for i in range(64)}
    line = json.dumps({"values": values, "table": table})
    with record_function("same_work.b"):
        u = torch.zeros(1024)
        u += 1
        total = u.sum().item()
    keep["last"] = [*sorted(table.values(), reverse=True)[:3], len(line), total]


def _process(out: Any, rounds: int) -> None:
    own = torch.zeros(BUFFER_MB * (1 << 20) // 4)
    keep: dict[str, Any] = {}
    cpu = []
    for _ in range(rounds):
        time.sleep(SLEEP_S)
        c0 = time.thread_time()
        _one_pass(keep)
        cpu.append(time.thread_time() - c0)
        own.add_(1.0)
    out.put(statistics.median(cpu[len(cpu) // 4:]))  # the first rounds warm the interpreter


def pass_cpu_s(processes: int, rounds: int) -> float:
    """The median process's median CPU seconds for one pass, `processes` of them at once."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(out, rounds), daemon=True)
             for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        return statistics.median(out.get(timeout=JOIN_S) for _ in procs)
    finally:
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()  # by PID
                p.join(5.0)
