"""One rank of `bench/scale.py`: a forked process that runs the step protocol on a small tensor.

Invariant: the rank uses only recover's public API (`Member`, `FaultTolerantComm`, `StepEngine`,
their `stats`, and `engine.waiter`), logs one JSON line per committed step with everything the
parent needs to time the protocol (time.time(), one machine clock for every process), and checks
that every committed gradient is exactly the sum over the step's N ids of a known integer-valued
per-id gradient. It ends with `os._exit` (gloo teardown after a peer's death can block or
abort), after `Member.leave()` when told to stop, so a clean stop is not mistaken for a fault.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from recover.collectives import FaultTolerantComm, Member, ReplicaFault, connect
from recover.recovery import StepEngine
from recover.settings import FaultTolerance


@dataclass
class RankArgs:
    port: int
    replica: int
    rank: int  # position within the replica
    nranks: int  # P
    n: int  # microbatches per step
    numel: int
    compute_s: float  # sleep per microbatch: a compute phase a kill can land in, at no CPU cost
    timeout_s: float
    max_steps: int
    log: Path
    stop_file: Path  # holds the step at which every rank stops (written once by the parent)
    parent: int  # the bench's PID: an orphaned rank stops instead of stepping on forever
    trace: bool = False  # every engine store call and key wait, with its result, to stderr


def weight(i: int) -> float:
    """Microbatch i's gradient is weight(i) * pattern: small integers, so every sum is exact."""
    return float(i % 13 + 1)


def pattern(numel: int) -> torch.Tensor:
    return (torch.arange(numel) % 7 + 1).to(torch.float32)


def expected(step: int, n: int, base: torch.Tensor) -> torch.Tensor:
    return base * sum(weight(i) for i in range(step * n, step * n + n))


class TimedComm(FaultTolerantComm):
    """Records each reduce call: [generation, start, end, True or why it failed, barrier s, build s,
    collective s, build CPU s (this process's CPU clock over barrier + build, every thread),
    this process's CPU clock (every thread) at the start]."""

    def __init__(self, member: Member, position: int, timeout_s: float) -> None:
        super().__init__(member, position=position, timeout_s=timeout_s)
        self.calls: list[list[Any]] = []

    def reduce_(self, tensors: Sequence[torch.Tensor], generation: int | None = None,
                on_issued: Callable[[], None] | None = None) -> None:
        g = self.member.generation() if generation is None else generation
        s0 = dict(self.stats)
        t0, c0 = time.time(), time.process_time()
        ok: bool | str = False
        try:
            super().reduce_(tensors, g, on_issued)
            ok = True
        except ReplicaFault as e:
            ok = e.why[:120] or False  # falsy only if it gave no reason
            print(f"{time.time():.4f} reduce in generation {g} failed: {e.why}", file=sys.stderr,
                  flush=True)
            raise
        finally:
            s1 = self.stats
            self.calls.append([g, t0, time.time(), ok, s1["barrier_s"] - s0["barrier_s"],
                               s1["build_s"] - s0["build_s"], s1["reduce_s"] - s0["reduce_s"],
                               s1["build_cpu_s"] - s0["build_cpu_s"], c0])


class TracedStore:
    """Forwards to the engine's store client and prints each call with its result (--trace):
    to see which decision or chain value each rank read when ranks disagree."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any) -> Any:
            t0 = time.time()
            out: Any = "raised"
            try:
                out = attr(*args)
                return out
            finally:
                trace(t0, f"{name}{args!r:.160} -> {out!r:.80}")
        return call


def trace(t0: float, what: str) -> None:
    print(f"trace {t0:.4f} +{time.time() - t0:.4f} {what}", file=sys.stderr, flush=True)


def trace_waits(engine: StepEngine) -> None:
    """Print each of the engine's blocking key waits (main store, own shard) with its result."""
    for waiter in (engine.waiter, getattr(engine, "shard_waiter", None)):
        if waiter is None:
            continue

        def traced(*a: Any, _get: Any = waiter.get, **k: Any) -> Any:
            t0 = time.time()
            out = _get(*a, **k)
            trace(t0, f"wait{a!r:.160} -> {out!r:.80}")
            return out

        waiter.get = traced  # type: ignore[method-assign]


def stop_step(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def rank_main(a: RankArgs) -> NoReturn:
    torch.set_num_threads(1)
    ft = FaultTolerance(join_timeout_s=a.timeout_s, reduce_timeout_s=a.timeout_s)
    member = Member("127.0.0.1", a.port, a.replica, a.rank, a.nranks, ft=ft)
    comm = connect(member, ft, comm_class=TimedComm)
    grad = torch.zeros(a.numel)
    # The engine's "commit" hook runs as soon as its reduce step is over, failed or not: the
    # gap from the end of a failed reduce_ call to it is the cost of discarding the attempt
    # (e.g. destroying a gloo group a dead peer left mid-operation).
    # With it, the process's CPU clock (every thread): the control plane's own work from the
    # last reduce's end to the commit, without the wait for a share of the machine's cores.
    after: list[float] = []
    after_cpu: list[float] = []

    def hook(phase: str, step: int, j: int) -> None:
        if phase == "commit":
            after.append(time.time())
            after_cpu.append(time.process_time())

    engine = StepEngine(member, comm, grad, a.n, timeout_s=a.timeout_s, positions=a.nranks,
                        hook=hook)
    if a.trace:
        trace_waits(engine)
        engine.store = TracedStore(engine.store)
    base = pattern(a.numel)
    log = open(a.log, "a", buffering=1)
    log.write(json.dumps({"ev": "joined", "t": time.time(), "pid": os.getpid(),
                          "gen": member.generation()}) + "\n")
    computes: list[list[float]] = []

    def compute(i: int, j: int) -> float:
        t0 = time.time()
        time.sleep(a.compute_s)
        grad.add_(base, alpha=weight(i))
        computes.append([t0, time.time()])
        return 0.0

    stop_at = None
    for step in range(a.max_steps):
        stop_at = stop_at if stop_at is not None else stop_step(a.stop_file)
        if (stop_at is not None and step >= stop_at) or os.getppid() != a.parent:
            break
        grad.zero_()
        computes.clear()
        after.clear()
        comm.calls.clear()
        ops0, waits0 = engine.stats["store_ops"], engine.store_waits
        res = engine.run(step, compute)
        t_commit, cpu_commit = time.time(), time.process_time()
        log.write(json.dumps({
            "ev": "step", "step": step, "gen": res.generation, "attempts": res.attempts,
            "t_commit": t_commit, "ops": engine.stats["store_ops"] - ops0,
            "waits": engine.store_waits - waits0, "reduces": comm.calls, "after": after,
            "control_cpu": cpu_commit - after_cpu[-1] if after_cpu else None,
            "computes": computes,
            "members": len(res.members),
            "correct": bool(torch.equal(grad, expected(step, a.n, base)))}) + "\n")
    member.leave()
    log.write(json.dumps({"ev": "done", "t": time.time()}) + "\n")
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Never return: destroying the gloo groups (this frame's locals) blocked forever in a rank
    # whose peers had gone, and can abort the process after a peer's death mid-operation.
    os._exit(0)
