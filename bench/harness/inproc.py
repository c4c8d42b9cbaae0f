"""In-process harness for layers 1-2: a real `Coordinator` and real members, as threads.

The coordinator serves in a thread of the test process (its `serve(should_stop)` loop); every rank
of every replica is a thread with its own `Member` (own store clients, own liveness socket), its own
`FaultTolerantComm` (a real gloo group per generation, over loopback) and its own `StepEngine`
over a small flat gradient. Per-id gradients are those of the integer-gradient oracle
(`harness.oracle`), so every sum is exact whatever the summation order: `check()` holds
every gradient any rank returned to the oracle's expected sum, exactly.

Faults are scripted at (replica, rank, step, phase, j):
- `kill`: the rank "dies" there: its liveness socket is shut (the coordinator sees a crash, as the
  kernel would show it), its heartbeats stop, and its thread blocks forever; any later use of its
  store blocks too, so it can never act again. Nothing of it is freed: a gloo group destroyed with
  an operation in flight aborts the interpreter, so dead ranks (and every harness) are kept in a
  graveyard that a never-ending daemon thread references until the process exits.
- `hang`: heartbeats stop while the socket stays open (SIGSTOP): the coordinator fences it for a
  stale heartbeat; `on_fenced` marks it dead (instead of `os._exit`).
- `hold`: the thread waits until a generation newer than the current one is published, then goes
  on (a rank that is late and skips a generation).
- `raise`: the rank's reduce completes (its part is in everyone's sum) and then raises
  `ReplicaFault` and reports the failure, as a ring neighbour of a killed peer does: a split.
- `forge`: someone outside the protocol writes `commit` into this step's decision keys, for every
  generation up to the newest this rank knows (a forged store key, or a protocol slip).
- `outcome` phase: the fault fires right after the rank wrote its outcome for the step.
Phases: `compute` (before microbatch j is added), `reduce` (the collective is in flight), `commit`
(reduced, outcome not yet written), `outcome`, `optimizer` (after the step committed here).

Store key formats read here (decisions, chain entries) are those of recover.recovery.step.
"""

from __future__ import annotations

import contextlib
import json
import resource
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness import oracle
from harness.threadlink import PositionLink, ThreadLink
from recover.collectives import FaultTolerantComm
from recover.collectives.comm import Flight, ReplicaFault
from recover.control import Coordinator, CoordinatorConfig, Member, keys
from recover.control.keys import try_get
from recover.recovery import StepResult
from recover.replica.rank import connect_rank, new_member
from recover.settings import FaultTolerance, Hooks, LaunchEnv, ReplicaConfig

_GRAVE: list[object] = []  # everything a harness created; never freed (see the docstring)
# Kept harnesses hold their sockets (~80 per harness: stores, liveness, gloo pairs): lift the
# soft limit on open files (1024 on many systems) to the hard one for this test process.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
_want = 65536 if _hard == resource.RLIM_INFINITY else min(_hard, 65536)
if _soft != resource.RLIM_INFINITY and _soft < _want:
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (_want, _hard))
_FOREVER = threading.Event()  # never set


def _keeper(grave: list[object]) -> None:
    _FOREVER.wait()  # this frame references `grave` until the interpreter is gone


threading.Thread(target=_keeper, args=(_GRAVE,), name="inproc-graveyard", daemon=True).start()


def _close_ended() -> None:
    """Close the coordinators of the harnesses whose run ended (their tests have read them by
    the time a new harness is made): their store servers' connections are thousands of the
    sockets that every group build's census walks (`Harness._release_finished`). One whose
    coordinator still serves (its run failed) is left alone: stopping it would make its live
    ranks' partition watchdogs end the test process."""
    for old in _GRAVE:
        if isinstance(old, Harness) and not old.closed and old.ended:
            old.coord.close()
            old.closed = True


@dataclass
class Fault:
    replica: int
    step: int
    phase: str  # compute | reduce | commit | outcome | optimizer
    j: int = 0  # compute: the rank's j-th microbatch of the step
    # kill | hang | hold | raise | forge; "kill-reduced": a kill once every rank of the replica
    # has reduced this step (at its commit hook), which a plain kill at one rank's commit cannot
    # promise of its siblings on a loaded machine
    action: str = "kill"
    rank: int = 0
    fired: bool = False


class _Dead(threading.Event):
    """Set when the rank died; `block()` parks a dead rank's thread for good."""

    def block(self) -> None:
        _FOREVER.wait()


class _Archive:
    """What the ranks wrote to the step protocol's keys (`step/...`), per store ("main", or
    "shard{k}"). The protocol deletes a step's keys two commits later (recovery/lifetime.py), so
    the checks read the store, else this. A write-once key written again with another value (one
    re-created after its deletion) is a conflict, which `check()` fails on."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], bytes] = {}
        self.conflicts: list[tuple[str, str, bytes, bytes]] = []
        self._lock = threading.Lock()

    def note(self, where: str, name: str, args: tuple, out: Any) -> None:
        key = str(args[0])
        if not key.startswith("step/"):
            return
        with self._lock:
            old = self.values.get((where, key))
            if name == "add":  # a counter: its highest value
                self.values[(where, key)] = str(max(int(out), int(old or 0))).encode()
                return
            if name == "compare_set" and args[1] in ("", b""):  # written once (else a read)
                value = bytes(out)
            elif name == "set":  # a store shard's copy of a decision
                value = args[1].encode() if isinstance(args[1], str) else bytes(args[1])
            else:
                return
            if old is not None and old != value:
                self.conflicts.append((where, key, old, value))
            self.values[(where, key)] = value


class _StoreProxy:
    """The member's store: refuses (blocks forever) once its rank is dead; reports writes, and
    archives those of step keys."""

    def __init__(self, real: Any, dead: _Dead, on_write: Callable[[str], None],
                 archive: _Archive, where: str) -> None:
        self._real, self._dead, self._on_write = real, dead, on_write
        self._archive, self._where = archive, where

    def clone(self) -> Any:  # for background threads and gloo: real clients
        return self._real.clone()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._real, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._dead.is_set():
                self._dead.block()
            out = method(*args, **kwargs)
            if name in ("set", "compare_set", "add") and args:
                self._archive.note(self._where, name, args, out)
                self._on_write(str(args[0]))
            return out

        return call


class _Comm(FaultTolerantComm):
    """FaultTolerantComm whose reduce can be scripted to raise after it completed (a split)."""

    rank_state: Rank

    def complete(self, flight: Flight, on_issued: Callable[[], None] | None = None) -> None:
        super().complete(flight, on_issued)
        if self.rank_state.should_raise():
            g = flight.g
            self.member.report_fail(g)
            raise ReplicaFault(g, [], "scripted: completed here, raised like a killed peer's "
                                      "neighbour")


class Rank:
    """One rank of one replica, run by a thread."""

    def __init__(self, h: Harness, replica: int, rank: int) -> None:
        self.h, self.replica, self.rank = h, replica, rank
        self.dead = _Dead()
        self.fenced: str | None = None
        self.error: str | None = None
        self.results: dict[int, tuple[StepResult, torch.Tensor]] = {}
        self.computed: dict[int, list[int]] = {}  # step -> ids this rank computed in it
        self.prefetched: dict[int, list[int]] = {}  # step -> ids `prefetch` named for it
        self.ops: dict[int, float] = {}  # step -> the engine's store round trips in that step
        self.step = -1
        self.done = threading.Event()
        self.member: Member | None = None
        self.comm: FaultTolerantComm | None = None
        self.engine: Any = None
        self.grad = torch.zeros(0)
        self.base = torch.zeros(0)  # this rank's oracle pattern
        self.thread = threading.Thread(target=self._main, name=f"rank-{replica}.{rank}",
                                       daemon=True)

    @property
    def name(self) -> str:
        return f"{self.replica}.{self.rank}"

    # -- faults --------------------------------------------------------------------------------
    def _due(self, action_raise: bool, phase: str, j: int) -> Fault | None:
        for f in self.h.faults:
            if (not f.fired and (f.action == "raise") == action_raise and f.phase == phase
                    and (f.replica, f.rank, f.step) == (self.replica, self.rank, self.step)
                    and (phase != "compute" or f.j == j)):
                f.fired = True
                return f
        return None

    def fire(self, phase: str, j: int = 0) -> None:
        """Apply the scripted kill/hang/hold due at this point, if any."""
        f = self._due(False, phase, j)
        if f is None:
            return
        if f.action in ("kill", "kill-reduced"):
            if f.action == "kill-reduced":
                self.h.wait_reduced(self.replica, self.step)
            self.kill()
            self.dead.block()
        elif f.action == "hang":
            assert self.member is not None
            self.member.stop_heartbeats()
            self.dead.wait(self.h.timeout_s)  # until fenced (or the test fails on timeout)
            self.dead.block()
        elif f.action == "hold":
            assert self.member is not None
            self.member.wait_newer(self.member.generation(), self.h.timeout_s)
        elif f.action == "forge":
            assert self.member is not None
            for g in range(self.member.generation() + 1):  # the reduce's, or a newer one
                self.h.store().compare_set(keys.decision_key(self.step, g), "", "commit")

    def should_raise(self) -> bool:
        """A `raise` fault is due now (the reduce just completed here)."""
        return self._due(True, "reduce", 0) is not None

    def kill(self) -> None:
        """What a SIGKILL does to the outside world: the liveness socket closes, silence (and
        its siblings' intra-replica waits fail)."""
        self.dead.set()
        if self.member is not None:
            self.member.crash()
        for links in (self.h.links, self.h.lockstep):  # its siblings' waits there fail
            link = links.get(self.replica)
            if link is not None:
                link.barrier.abort()

    def _on_fenced(self, why: str) -> None:
        self.fenced = why
        self.kill()  # a fenced process exits: its socket closes, it never acts again

    def _on_write(self, key: str) -> None:
        # The outcome: counted (`add`) failure-free, or as evidence after a membership change.
        if f"step/{self.step}/" in key and ("/ev" in key or key.endswith("/count")):
            self.fire("outcome", 0)

    # -- the rank's life -----------------------------------------------------------------------
    def _main(self) -> None:
        h = self.h
        try:
            member = new_member(h.config(self.replica), self.rank, h.positions,
                                on_fenced=self._on_fenced)
            self.member = member
            # Every client of the main store dies with the rank, the communicator's plain one
            # too (uncounted here: the harness counts nothing of the store).
            member.store = member.plain_store = _StoreProxy(
                member.plain_store, self.dead, self._on_write, h.archive, "main")
            shard = member.connect_shard  # the shard's client dies with the rank too

            def connect_shard(index: int) -> Any:
                client = shard(index)
                return None if client is None else _StoreProxy(
                    client, self.dead, self._on_write, h.archive, f"shard{index}")

            member.connect_shard = connect_shard  # type: ignore[method-assign]
            self.grad = grad = torch.zeros(h.numel, dtype=h.dtype)
            self.base = oracle.pattern(h.numel, self.rank, h.dtype)
            link = h.links.get(self.replica)
            stack = connect_rank(member, grad, h.n, h.config(self.replica),
                                 hooks=Hooks(at_phase=self._hook), comm_class=_Comm,
                                 link=None if link is None else PositionLink(link, self))
            comm, engine = stack.comm, stack.engine
            comm.rank_state = self  # type: ignore[attr-defined]
            self.comm = comm
            _GRAVE.extend([member, comm, engine, grad])
            self.engine = engine
            engine.prefetch = self.prefetched.__setitem__
            for t in range(h.steps):
                self.step = t
                self.ops[t] = engine.stats["store_ops"] + engine.store_waits
                grad.zero_()
                res = engine.run(t, self._compute)
                self.results[t] = (res, grad.clone())
                # Store round trips: the engine's own, and its blocking key waits (one each, on
                # a helper thread with its own client, which the engine's counter leaves out).
                self.ops[t] = engine.stats["store_ops"] + engine.store_waits - self.ops[t]
                if h.records and self.rank == 0:  # as the trainer does: the sink deletes old keys
                    member.store.set(keys.record_key(t), json.dumps(
                        {"step": t, "generation": res.generation, "attempts": res.attempts,
                         "members": res.members, "t_commit": time.time(), "step_time_s": 0.01,
                         "live_replicas": len(res.members), "recovered": res.recovered,
                         "loss": res.loss}))
                self.fire("optimizer", 0)
            member.leave()
        except BaseException:
            if not self.dead.is_set():
                self.error = traceback.format_exc()
                # As a process that raised would: its liveness connection closes (a crash to the
                # coordinator), and its partition watchdog, which would otherwise end the whole
                # test process once the harness's coordinator stops, stops with it.
                if self.member is not None:
                    self.member.shutdown()
        finally:
            self.done.set()

    def _compute(self, i: int, j: int) -> float:
        self.fire("compute", j)
        lockstep = self.h.lockstep.get(self.replica)
        if lockstep is not None and not lockstep.together(self, (self.step, i)):
            self.h.out_of_step.append(f"{self.name}: step {self.step} id {i}: {lockstep.slots}")
        self.computed.setdefault(self.step, []).append(i)
        oracle.add(self.grad, i, self.base)
        return oracle.loss(i)

    def _hook(self, phase: str, step: int, j: int) -> None:
        if phase == "commit":
            self.h.reduced(self.replica, step)
        if phase in ("reduce", "commit"):
            self.fire(phase, j)
        if phase == "commit" and self.h.barrier is not None:
            self.h.barrier.wait(self.h.timeout_s)


@dataclass
class Setup:
    """One in-process scenario (the keyword arguments of `Harness`). `store_shards` None: the
    class's `Harness.default_shards`."""

    positions: int = 1  # ranks per replica
    n: int = 8  # microbatches per step
    steps: int = 3
    faults: list[Fault] = field(default_factory=list)
    stale_s: float = 3.0
    timeout_s: float = 30.0
    numel: int = 256
    speed_aware: bool = False
    min_replicas: int = 1
    barrier_at_commit: bool = False
    records: bool = False  # rank 0 writes step records, as the trainer does
    dtype: torch.dtype = torch.float32
    store_shards: int | None = None
    speaker: bool = False  # a multi-rank replica's position 0 speaks for it (recovery/speaker.py)
    # A multi-rank replica's positions meet once per microbatch, as FSDP's collectives make them
    # (a separate group from the speaker's link): a position computing another id is an error.
    lockstep: bool = True


class Harness:
    """A coordinator and `replicas` x `positions` ranks as threads; `run()` then `check()`.
    Keyword arguments: the fields of `Setup`."""

    default_shards = 0

    def __init__(self, tmp: Path, replicas: int, **options: Any) -> None:
        setup = Setup(**options)
        store_shards = self.default_shards if setup.store_shards is None else setup.store_shards
        self.records, self.dtype = setup.records, setup.dtype
        self.replicas, self.positions = replicas, setup.positions
        self.n, self.steps, self.faults = setup.n, setup.steps, setup.faults
        self.timeout_s, self.numel = setup.timeout_s, setup.numel
        self.speed_aware, self.min_replicas = setup.speed_aware, setup.min_replicas
        positions, timeout_s, stale_s = setup.positions, setup.timeout_s, setup.stale_s
        self.log = tmp / "coordinator.jsonl"
        self.archive = _Archive()  # what the ranks wrote to step keys (see `read`)
        self.coord = Coordinator(CoordinatorConfig(
            replicas=replicas, host="127.0.0.1", port=0, stale_s=stale_s,
            join_timeout_s=timeout_s, log_path=str(self.log), store_shards=store_shards))
        self.port = self.coord.start()
        top = self.coord.top  # with store shards it decides for the shards' leaders: archived
        if top is not None:
            never = _Dead()
            top.main = _StoreProxy(top.main, never, lambda _key: None, self.archive, "main")
            top.servers = [_StoreProxy(s, never, lambda _key: None, self.archive, f"shard{k}")
                           for k, s in enumerate(top.servers)]
        self.ended = self.closed = False
        self._stop = threading.Event()
        self._serve = threading.Thread(target=self.coord.serve, args=(self._stop.is_set,),
                                       name="inproc-coordinator", daemon=True)
        self.links = ({r: ThreadLink(positions, timeout_s) for r in range(replicas)}
                      if setup.speaker and positions > 1 else {})
        self.lockstep = ({r: ThreadLink(positions, timeout_s) for r in range(replicas)}
                         if setup.lockstep and positions > 1 else {})
        self.out_of_step: list[str] = []  # positions of one replica that computed different ids
        self.ranks = {(r, k): Rank(self, r, k) for r in range(replicas) for k in range(positions)}
        # Every rank waits here after its reduce, so all of them write outcomes and propose a
        # decision at the same moment (failure-free runs only: a dead rank would break it).
        self.barrier = threading.Barrier(len(self.ranks)) if setup.barrier_at_commit else None
        self._reduced: dict[tuple[int, int], int] = {}  # (replica, step) -> ranks at commit
        self._reduced_cv = threading.Condition()
        _close_ended()
        _GRAVE.append(self)

    def config(self, replica: int) -> ReplicaConfig:
        """Replica `replica`'s settings: this harness's coordinator and tolerances, nothing from
        the environment."""
        ft = FaultTolerance(heartbeat_s=0.05, join_timeout_s=self.timeout_s,
                            reduce_timeout_s=self.timeout_s, min_replicas=self.min_replicas,
                            speed_aware=self.speed_aware)
        return ReplicaConfig(coordinator=f"127.0.0.1:{self.port}", replica=replica, ft=ft,
                             launch=LaunchEnv())

    def reduced(self, replica: int, step: int) -> None:
        """A rank of `replica` reached its commit hook in `step`: its reduce is done."""
        with self._reduced_cv:
            key = (replica, step)
            self._reduced[key] = self._reduced.get(key, 0) + 1
            self._reduced_cv.notify_all()

    def wait_reduced(self, replica: int, step: int) -> None:
        """Until every rank of `replica` has reduced `step` (bounded by the harness's timeout)."""
        with self._reduced_cv:
            done = self._reduced_cv.wait_for(
                lambda: self._reduced.get((replica, step), 0) >= self.positions, self.timeout_s)
        assert done, f"replica {replica}'s ranks did not all reduce step {step}"

    def run(self, timeout_s: float = 90.0) -> Harness:
        self._serve.start()
        for rank in self.ranks.values():
            rank.thread.start()
        deadline = time.monotonic() + timeout_s
        for rank in self.ranks.values():
            while not (rank.done.is_set() or rank.dead.is_set()):
                if time.monotonic() > deadline:
                    raise AssertionError(f"rank {rank.name} neither finished nor died within "
                                         f"{timeout_s}s\n{self.diagnostics()}")
                rank.done.wait(0.02)
        self._stop.set()
        self._serve.join(10)
        self.ended = not self._serve.is_alive()
        self._release_finished()
        errors = {r.name: r.error for r in self.ranks.values() if r.error}
        assert not errors, "\n".join(f"rank {k}:\n{v}" for k, v in errors.items())
        unfired = [f for f in self.faults if not f.fired]
        assert not unfired, f"scripted faults that never fired: {unfired}"
        return self

    def _release_finished(self) -> None:
        """Close the engines and groups of the ranks that finished (none of their operations is
        in flight): their threads and store connections end.
        Why: the test process keeps every harness, and each group build takes a census of the
        process's sockets (`recover.collectives.sever`), so what earlier tests left open made
        later builds slower and slower (a 2 s test took 10 s after 30 others). Dead and hung
        ranks keep theirs: a group destroyed with an operation in flight aborts the process."""
        for rank in self.ranks.values():
            if rank.done.is_set() and not rank.dead.is_set() and rank.comm is not None:
                rank.engine.close()
                rank.comm.close()

    # -- checks --------------------------------------------------------------------------------
    def survivors(self) -> list[int]:
        return sorted({r for (r, _), rank in self.ranks.items()
                       if not any(self.ranks[(r, k)].dead.is_set()
                                  for k in range(self.positions))})

    def store(self) -> Any:
        return self.coord.client

    def read(self, key: str, shard: int | None = None) -> bytes | None:
        """A step key's value in the main store (or in store shard `shard`), else the value the
        ranks wrote there before the protocol deleted it (recovery/lifetime.py)."""
        store = self.store() if shard is None else self.coord.shards[shard]
        value = try_get(store, key)
        where = "main" if shard is None else f"shard{shard}"
        return value if value is not None else self.archive.values.get((where, key))

    def generations(self) -> dict[int, list[int]]:
        return {e["gen"]: e["members"] for e in self.events("generation")}

    def events(self, kind: str) -> list[dict]:
        return [e for e in map(json.loads, self.log.read_text().splitlines()) if e["event"] == kind]

    def chain(self, step: int) -> list[dict]:
        """The ownership chain `step` committed on: entry 0 from the store, or the plan a
        survivor implied (recovery/step.py), then the stored entries after it."""
        first = next((res.chain for rank in self.ranks.values()
                      for t, (res, _) in rank.results.items() if t == step), None)
        assert first is not None, f"no rank committed step {step}"
        stored = self.read(keys.chain_key(step, 0))
        assert stored is None or json.loads(stored) == first[0], (stored, first)
        for k, entry in enumerate(first[1:], 1):
            assert json.loads(self.read(keys.chain_key(step, k)) or b"null") == entry
        return first

    def decision(self, step: int, g: int) -> bytes | None:
        return self.read(keys.decision_key(step, g))

    def check(self, survivors: list[int]) -> dict[int, StepResult]:
        """Every result any rank returned is exact; the survivors finished every step; each step
        committed in exactly one generation, the one every rank that returned it reports."""
        assert self.survivors() == survivors, (self.survivors(), self.diagnostics())
        assert not self.out_of_step, self.out_of_step  # a replica's positions computed apart
        assert not self.archive.conflicts, self.archive.conflicts  # no key re-created
        gens = sorted(self.generations())
        first: dict[int, StepResult] = {}
        for rank in self.ranks.values():
            if rank.replica in survivors:
                assert sorted(rank.results) == list(range(self.steps)), rank.name
            for t, (res, grad) in rank.results.items():
                base = oracle.pattern(self.numel, rank.rank)
                want = oracle.expected(t, self.n, base).to(grad.dtype)
                assert torch.equal(grad, want), (
                    f"rank {rank.name} step {t}: reduced gradient is off by "
                    f"{float((grad - want).abs().max())} (quotas {res.quotas})")
                assert res.microbatches == self.n and sum(res.quotas.values()) == self.n, res
                assert res.loss == oracle.expected_loss(t, self.n), res
                assert res.step == t and rank.replica in res.members
                ref = first.setdefault(t, res)
                assert (res.generation, res.quotas, res.members) == \
                    (ref.generation, ref.quotas, ref.members), (rank.name, res, ref)
        for t, ref in first.items():
            decided = {g: self.read(keys.decision_key(t, g)) for g in gens}
            commits = [g for g, v in decided.items() if keys.is_commit(v)]
            assert commits == [ref.generation], (t, decided)
            for k in range(len(self.coord.shards)):  # only copies of the main decision
                for g in gens:
                    copy = self.read(keys.decision_key(t, g), shard=k)
                    assert copy is None or copy == decided[g], (t, g, k, copy, decided[g])
        return first

    def diagnostics(self) -> str:
        lines = [self.log.read_text() if self.log.exists() else "(no coordinator log)"]
        for rank in self.ranks.values():
            lines.append(f"rank {rank.name}: step {rank.step} dead={rank.dead.is_set()} "
                         f"fenced={rank.fenced} done={rank.done.is_set()} "
                         f"results={sorted(rank.results)} error={rank.error}")
        return "\n".join(lines)
