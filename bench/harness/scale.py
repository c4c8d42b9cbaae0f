"""The protocol ranks of `bench/scale.py` as processes, and the helpers that start, watch and end
them.

Invariants:
- A rank is a real process forked by `recover.procs.Spawner` (its fork server imported torch and
  recover once) and wired by the library's one wiring (`recover.replica.rank`); it uses only
  recover's public API (`Member`, `FaultTolerantComm`, `StepEngine`, their `stats`, and
  `engine.waiter`), logs one JSON line per committed step with everything the parent needs to
  time the protocol (time.time(), one machine clock for every process) and to count its store
  requests (every client it opens, counted by server: `recover.control.storecount`), and checks
  each committed gradient against the integer-gradient oracle (`harness.oracle`),
  exactly.
  It ends with `os._exit` (gloo teardown after a peer's death can block or abort), after
  `Member.leave()` when told to stop, so a clean stop is not mistaken for a fault.
- The coordinator (`coordinator_main`) counts the requests its own clients send to its main
  store (a generation's publication) into a file the parent reads, with a snapshot taken on the
  coordinator's own thread right after each decision it writes (one compare-and-set a step), so
  the parent can take a failure-free step's share out exactly, not by a rate.
- `Children` signals a process only through its handle (never a recycled PID) and ends every one
  by PID; every wait here is bounded.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from harness import oracle
from recover.collectives import FaultTolerantComm, ReplicaFault
from recover.collectives.comm import Flight
from recover.control import coordinator, keys
from recover.control.storecount import CountedStore, Tally, counting_connect
from recover.procs import Process, Spawner, alive, stop_all
from recover.recovery import StepEngine
from recover.replica.link import IntraReplicaLink
from recover.replica.rank import RankStack, connect_rank, new_member
from recover.settings import FaultTolerance, Hooks, LaunchEnv, ReplicaConfig

log = logging.getLogger(__name__)

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
    parent: int  # the bench's PID: a rank whose bench is gone stops instead of stepping on
    trace: bool = False  # every engine store call and key wait, with its result, to stderr
    speaker: bool = False  # P > 1: the replica's rank 0 speaks for it (its ranks' own group)


class TimedComm(FaultTolerantComm):
    """Records each reduce (from `open`, which may build the group, to the end of `complete`):
    [generation, start, end, True or why it failed, barrier s, build s, collective s, build CPU s
    (this process's CPU clock over barrier + build, every thread), this process's CPU clock
    (every thread) at the start, and at the end]."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[list[Any]] = []
        self._start: tuple[int, dict[str, float], float, float] | None = None

    def open(self, generation: int | None = None, hold: Sequence[torch.Tensor] = ()) -> Flight:
        g = self.member.generation() if generation is None else generation
        self._start = (g, dict(self.stats), time.time(), time.process_time())
        try:
            return super().open(g, hold)
        except BaseException as e:
            self._record(e)
            raise

    def complete(self, flight: Flight, on_issued: Callable[[], None] | None = None) -> None:
        try:
            super().complete(flight, on_issued)
        except BaseException as e:
            self._record(e)
            raise
        self._record(None)

    def _record(self, error: BaseException | None) -> None:
        if self._start is None:
            return
        (g, s0, t0, c0), self._start = self._start, None
        ok: bool | str = True
        if error is not None:
            why = error.why if isinstance(error, ReplicaFault) else ""
            ok = why[:120] or False  # falsy only if it gave no reason
            log.warning("%.4f reduce in generation %d failed: %s", time.time(), g, why or error)
        s1 = self.stats
        self.calls.append([g, t0, time.time(), ok, s1["barrier_s"] - s0["barrier_s"],
                           s1["build_s"] - s0["build_s"], s1["reduce_s"] - s0["reduce_s"],
                           s1["build_cpu_s"] - s0["build_cpu_s"], c0, time.process_time()])


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
    log.debug("trace %.4f +%.4f %s", t0, time.time() - t0, what)


def trace_waits(engine: StepEngine) -> None:
    """Print each of the engine's blocking key waits (main store, own shard) with its result."""
    for waiter in (engine.waiter, engine.decision.shard_waiter):
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


class _Timing:
    """What one step's hook and compute saw: when the reduce step ended (the engine's "commit"
    hook runs as soon as it is over, failed or not: the gap from a failed reduce_ call's end to
    it is the cost of discarding the attempt), this process's CPU clock then (the control
    plane's own work from there to the commit, without the wait for a share of the cores), each
    microbatch's compute span, and [time.time(), CPU clock] at every hook (`marks`: the parent
    reads a survivor's CPU clock at a kill off the last mark before it)."""

    def __init__(self) -> None:
        self.after: list[float] = []
        self.after_cpu: list[float] = []
        self.computes: list[list[float]] = []
        self.marks: list[list[float]] = []

    def hook(self, phase: str, step: int, j: int) -> None:
        self.marks.append([time.time(), time.process_time()])
        if phase == "commit":
            self.after.append(time.time())
            self.after_cpu.append(time.process_time())

    def clear(self) -> None:
        self.after.clear()
        self.after_cpu.clear()
        self.computes.clear()
        self.marks.clear()


def _connect(a: RankArgs, timing: _Timing, grad: torch.Tensor, tally: Tally) -> RankStack:
    ft = FaultTolerance(join_timeout_s=a.timeout_s, reduce_timeout_s=a.timeout_s)
    config = ReplicaConfig(coordinator=f"127.0.0.1:{a.port}", replica=a.replica, ft=ft,
                           launch=LaunchEnv())
    member = new_member(config, a.rank, a.nranks)
    # Every main-store client this rank opens is a clone of the member's protocol client (its
    # threads', key waiters', the lifetime deleter's) or of its plain one (each group build's,
    # gloo's), so wrapping both before the join counts them all; a shard's clients apart.
    member.store = CountedStore(member.store, tally, "main")  # type: ignore[assignment]
    member.plain_store = CountedStore(member.plain_store, tally, "main")  # type: ignore[assignment]
    shard = member.connect_shard

    def connect_shard(index: int) -> Any:
        client = shard(index)
        return None if client is None else CountedStore(client, tally, "shard")

    member.connect_shard = connect_shard  # type: ignore[method-assign]
    if a.trace:  # the engine's store calls go through the member's client
        member.store = TracedStore(member.store)
    link = _replica_link(a, member) if a.speaker and a.nranks > 1 else None
    stack = connect_rank(member, grad, a.n, config, hooks=Hooks(at_phase=timing.hook),
                         comm_class=TimedComm, link=link)
    if a.trace:
        trace_waits(stack.engine)
    return stack


def _replica_link(a: RankArgs, member: Any) -> IntraReplicaLink:
    """A multi-rank replica's own gloo group (its P ranks meet in a file beside their logs, as
    a torchrun's would on its store) and the link its speaker decides and reads the chain over
    (recovery/speaker.py). A sibling's death fails the link's calls here with gloo's error: the
    rank then exits with it, as its replica is lost anyway (`Replica.guard` also reports it)."""
    store = dist.FileStore(str(a.log.parent / f"replica{a.replica}.group"), a.nranks)
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.nranks,
                            timeout=datetime.timedelta(seconds=a.timeout_s))
    return IntraReplicaLink(member, torch.device("cpu"), 6 * a.timeout_s + 10,
                            contextlib.nullcontext)


def rank_main(a: RankArgs) -> NoReturn:
    """One rank: join, step until the stop file's step (or the bench is gone), leave."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.DEBUG if a.trace else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack to its log
    timing, grad, base = _Timing(), torch.zeros(a.numel), oracle.pattern(a.numel)
    tally = Tally(keep_alive=True)  # gloo holds the clients it builds on (storecount.py)
    stack = _connect(a, timing, grad, tally)
    member, engine, comm = stack.member, stack.engine, stack.comm
    assert isinstance(comm, TimedComm)
    steps = open(a.log, "a", buffering=1)
    steps.write(json.dumps({"ev": "joined", "t": time.time(), "pid": os.getpid(),
                            "gen": member.generation()}) + "\n")

    def compute(i: int, j: int) -> float:
        t0 = time.time()
        timing.marks.append([t0, time.process_time()])
        time.sleep(a.compute_s)
        oracle.add(grad, i, base)
        timing.computes.append([t0, time.time()])
        return 0.0

    stop_at = None
    for step in range(a.max_steps):
        stop_at = stop_at if stop_at is not None else stop_step(a.stop_file)
        if (stop_at is not None and step >= stop_at) or not alive(a.parent):
            break
        grad.zero_()
        timing.clear()
        comm.calls.clear()
        ops0, waits0 = engine.stats["store_ops"], engine.store_waits
        res = engine.run(step, compute)
        t_commit, cpu_commit = time.time(), time.process_time()
        steps.write(json.dumps({
            "ev": "step", "step": step, "gen": res.generation, "attempts": res.attempts,
            "t_commit": t_commit, "ops": engine.stats["store_ops"] - ops0,
            "waits": engine.store_waits - waits0, "reduces": comm.calls, "after": timing.after,
            "control_cpu": cpu_commit - timing.after_cpu[-1] if timing.after_cpu else None,
            "computes": timing.computes, "members": len(res.members),
            "cpu_commit": cpu_commit, "marks": timing.marks,
            "main_reqs": tally.total("main"), "shard_reqs": tally.total("shard"),
            # deletions already queued, not yet sent: counted at the commit that queued them
            "main_pending": engine.lifetime.pending("main"),
            "shard_pending": engine.lifetime.pending("shard"),
            "shard_bytes": tally.bytes_served("shard"),
            "probes": comm.stats["probes"],
            "main_kinds": tally.by_kind("main"),
            "correct": bool(torch.equal(grad, oracle.expected(step, a.n, base).float()))}) + "\n")
    member.leave()
    steps.write(json.dumps({"ev": "done", "t": time.time()}) + "\n")
    steps.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Never return: destroying the gloo groups (this frame's locals) blocked forever in a rank
    # whose peers had gone, and can abort the process after a peer's death mid-operation.
    os._exit(0)


@dataclass
class CoordArgs:
    argv: list[str]  # `recover coordinator`'s flags
    count_file: Path  # where the requests its clients sent to its main store are kept


def coordinator_main(a: CoordArgs) -> int:
    """`recover coordinator` whose store clients count their requests (all of them go to its
    main store: it serves its shards, it never connects to them), written to `a.count_file`
    every 20 ms as JSON: `total`, and `decisions` with `at_decision`, the decisions it wrote so
    far and the total right after the last one (both read on the loop thread that writes them:
    a consistent pair, whenever the file is read)."""
    from recover.control import shards

    tally = Tally()
    # The coordinator connects its one client through keys.connect_store; in this forked
    # process only, every client it makes counts.
    keys.connect_store = counting_connect(keys.connect_store, tally, None)  # type: ignore
    path, tmp = a.count_file, a.count_file.with_suffix(".tmp")
    decided = {"decisions": 0, "at_decision": 0}
    top = shards.TreeTop.counted

    def counted(self: Any, words: list[str]) -> bytes | None:
        out = top(self, words)
        if out is not None:  # a decision written: one compare-and-set on the main store
            decided.update(decisions=decided["decisions"] + 1, at_decision=tally.total("main"))
        return out

    shards.TreeTop.counted = counted  # type: ignore[method-assign]

    def write() -> None:
        while True:
            tmp.write_text(json.dumps({"total": tally.total("main"), **decided}))
            os.replace(tmp, path)
            time.sleep(0.02)

    threading.Thread(target=write, name="bench-coord-requests", daemon=True).start()
    return coordinator.main(a.argv)


class Children:
    """Our processes by name, forked by one `Spawner`: started with `call`, signalled through
    their handles (never a recycled PID), ended by PID; `code` holds the exit codes seen."""

    def __init__(self, preload: Sequence[str] = ("harness.scale",
                                                  "recover.control.coordinator")) -> None:
        self.spawner = Spawner(preload)
        self.procs: dict[Any, Process] = {}
        self.pid: dict[Any, int] = {}
        self.code: dict[Any, int] = {}  # exit codes of the ones that exited

    def call(self, name: Any, fn: Callable[[Any], Any], arg: Any, log: Path) -> int:
        """Fork a process `name` that runs fn(arg), stdout/stderr appended to `log`; its PID."""
        proc = self.procs[name] = self.spawner.call(fn, arg, log)
        self.pid[name] = proc.pid
        return proc.pid

    def reap(self) -> None:
        """Record the exit codes of those that exited since."""
        for name, proc in self.procs.items():
            if name not in self.code and proc.poll() is not None:
                self.code[name] = proc.poll()  # type: ignore[assignment]

    def unreaped(self) -> list[int]:
        self.reap()
        return [self.pid[n] for n in self.procs if n not in self.code]

    def signal(self, name: Any, sig: int) -> None:
        """Send `sig` to process `name`; a no-op once it exited."""
        self.procs[name].send_signal(sig)

    def stop(self, names: Sequence[Any], grace_s: float = 5.0) -> None:
        """End `names` by PID (SIGCONT, SIGTERM, SIGKILL after `grace_s`); reap them."""
        stop_all([self.procs[n] for n in names if n in self.procs], grace_s)
        self.reap()


def dump_stacks(kids: Children, names: list[Any]) -> None:
    """Ask each live rank for its threads' stacks (in its log): why a run got stuck."""
    kids.reap()
    for n in names:
        if n not in kids.code:
            kids.signal(n, signal.SIGUSR1)
    time.sleep(1.0)


def pss_mib(pids: list[int]) -> tuple[float, float]:
    """(sum of proportional set sizes, max resident set size) of `pids`, MiB, from /proc."""
    total, top = 0.0, 0.0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in text.splitlines()[1:]}
        total += kb.get("Pss", 0) / 1024
        top = max(top, kb.get("Rss", 0) / 1024)
    return total, top


class Tail:
    """Reads the complete JSON lines appended to a log since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.recs = path, 0, []

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.recs
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        self.recs += [json.loads(ln) for ln in chunk[:end].splitlines() if ln.strip()]
        return self.recs

    def steps(self) -> list[dict]:
        return [r for r in self.read() if r.get("ev") == "step"]


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)
