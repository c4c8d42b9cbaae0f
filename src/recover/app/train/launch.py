"""`recover train` on one machine: a coordinator process, R replica processes, a metrics sink.

Invariant: the launcher never kills a survivor because another replica died (only a `Watch` its
caller passes in may: the checkpoint-restart baseline's, never `recover train`'s); it only reads the
step records, and ends processes (by PID, through their handles) once the run is over or cannot go
on. Every wait is bounded. User mistakes are caught before any process starts, as one-line
RecoverErrors. The config is checked once per launch (or comes checked, from the CLI) into an
immutable `PreparedRun` (recover.app.train.prepared), whose parsed faults the launch reads from then
on; supervising the processes, winding them down and describing how they exited:
recover.app.train.supervision. Processes are started by `recover.procs.Spawner` (forked by the
standard library's fork server, which imports torch once for the whole launch, not once per process;
plain subprocesses with `RECOVER_FORKSERVER=0`), and every one of them is ended by PID when the
launch ends, whatever happened. What a user reads (the run's header, how replicas exited, a
coordinator restart, what `--resume` chose) goes to the console the CLI passes in; the rest to
logging. The metrics sink's progress view and writers (TensorBoard, W&B) are closed before the
processes are ended, whatever happened. The launcher lifts its open-files limit to the hard one; a
file system that refuses its writes costs a console line (metrics.jsonl's: held and retried), never
the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from recover.app import rundir
from recover.app.config import CheckedConfig, RunConfig, fingerprint
from recover.app.endpoint import HttpConfig, serve
from recover.app.runtoken import run_token
from recover.app.train import foreign, supervision
from recover.app.train.checkpoint.files import write_atomic
from recover.app.train.metrics import MetricsSink, truncate_metrics
from recover.app.train.prepared import PreparedRun, prepare_run, say
from recover.app.train.progress import ProgressView
from recover.app.train.writers import open_writers
from recover.control import CoordinatorConfig, connect_store, keys, try_get
from recover.control.coordinator import LINE_PREFIX, raise_descriptor_limit
from recover.deadline import Deadline, poll_until
from recover.errors import RecoverError
from recover.procs import Process, Spawner, stop_all, wait_exit
from recover.settings import LaunchEnv

log = logging.getLogger(__name__)

# What the launch's processes import, once, in the fork server: the replica's and the
# coordinator's entry points, the training loop and the parallel layouts; and what torch imports
# lazily later: torch._dynamo (AdamW's constructor imports it, in every replica) and
# torch.distributed.checkpoint (the leader's first save), each seconds of CPU: imported once in
# the server, a launch pays them once, not once per process (docs/MEASUREMENTS.md, "Threads and
# start-up").
PRELOAD = ("recover.app.train.worker", "recover.control.coordinator",
           "recover.app.train.loop", "recover.replica", "recover.layouts", "torch._dynamo",
           "torch.distributed.checkpoint")


@dataclass
class RunResult:
    ok: bool
    out: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    exit_codes: dict[int, int | None] = field(default_factory=dict)  # rank 0 of each replica
    wall_s: float = 0.0
    # With a `watch` that ended the job (the ckpt-restart baseline's): the replicas whose exit
    # made it end the job, and when it saw that (time.time()); t_start is the base of `time_s`.
    aborted: list[int] = field(default_factory=list)
    t_abort: float = 0.0
    t_start: float = 0.0
    # Every process of every replica, "replica<r>.rank<k>" -> exit code (multi-rank layouts:
    # the killed rank -9, its fenced siblings 3).
    rank_exit_codes: dict[str, int | None] = field(default_factory=dict)
    # How each replica ended, in words: its exit code (replicas started here) and what the
    # coordinator saw (left cleanly / lost / fenced); the only source for external workers.
    exits: dict[int, str] = field(default_factory=dict)
    # Stopped early by a preemption (SIGTERM): `recover train` exits ExitCode.PREEMPTED.
    preempted: bool = False


class Watch(Protocol):
    """A policy its caller runs beside a launch's replicas (`launch(watch=...)`; the
    checkpoint-restart baseline's abort on a loss, recover.app.baselines.ckpt_restart): made
    from the replicas' rank-0 processes once they are started, it may end them; `stop()`ed
    before the run winds down. `lost`: the replicas whose exit made it end the job ([]: it
    did not); `t`: when (time.time())."""

    lost: list[int]
    t: float

    def stop(self) -> None: ...


def _coordinator_error(log_file: Path) -> str:
    """The coordinator's own one-line reason for not starting (its last "cannot start" line)."""
    with contextlib.suppress(OSError):
        for line in reversed(log_file.read_text(errors="replace").splitlines()):
            if LINE_PREFIX in line:
                return line.split(LINE_PREFIX, 1)[1].strip()
    return ""


def launch(cfg: RunConfig | CheckedConfig, console: Console | None = None, quiet: bool = False,
           external_workers: bool = False, port: int = 0,
           watch: Callable[[dict[int, Process]], Watch] | None = None, host: str | None = None,
           http: HttpConfig | None = None, preempt: threading.Event | None = None) -> RunResult:
    """Run training to the end (or until it cannot go on) and return what happened.

    With `external_workers`, no replica is started here: they are launched elsewhere (one
    `torchrun` per replica, pointed at this host's `port`), and this process is the control plane
    and the metrics sink.

    `cfg` is checked here, once, unless it comes checked (`RunConfig.checked`, as the CLI
    hands it on); from then on the launch reads the `PreparedRun` only.

    `watch`, given by a caller that is not `recover train` (the checkpoint-restart baseline's
    abort on a loss), is made from the replicas' rank-0 processes once they are started and may
    end the job; see `Watch` and `RunResult.aborted`.

    `preempt`, once set (the CLI's SIGTERM handler: a scheduler preempting the job), makes the
    run stop within `--preempt-grace-s`: the leader checkpoints the last committed step, the exit
    records are written, and the result says `preempted`.
    """
    console = console or Console(stderr=True)
    raise_descriptor_limit()
    # Before the fork server starts: it then preloads what a foreign model needs (transformers),
    # imported here already, and every replica is forked with it.
    model = (cfg.cfg if isinstance(cfg, CheckedConfig) else cfg).model
    foreign.resolve(model)
    # The fork server imports torch while the run is prepared. None for external workers: the
    # coordinator is then the only local process.
    spawner = Spawner((*PRELOAD, *foreign.preload(model)),
                      fork=False if external_workers else None).warm()
    endpoint = None
    try:
        prepared = _laid_out(cfg, console)
        endpoint = serve(Path(prepared.cfg.run.out), http)
        t_start = time.time()
        # On disk too: `time_s` in metrics.jsonl is relative to it, and other logs
        # (coordinator.jsonl) carry absolute clocks; bench/rejoin.py lines them up.
        (Path(prepared.cfg.run.out) / rundir.RUN_START).write_text(f"{t_start:.6f}\n")
        host = host or ("0.0.0.0" if external_workers else "127.0.0.1")
        run = _Launch(prepared, t_start, spawner, host)
        run.preempt = preempt or threading.Event()
        return run.run(console, quiet, external_workers, port, watch)
    finally:
        if endpoint is not None:
            endpoint.close()
        spawner.close()


class _Launch:
    """One launch's processes (the coordinator, every rank of every replica) and its run."""

    def __init__(self, prepared: PreparedRun, t_start: float, spawner: Spawner,
                 host: str) -> None:
        cfg = self.cfg = prepared.cfg
        self.faults, self.start, self.t_start = prepared.faults, prepared.start, t_start
        self.out = Path(cfg.run.out)
        self.end = cfg.run.stop_at or cfg.run.steps
        self.spawner, self.host = spawner, host
        self.coord: Process | None = None
        self.port = 0
        self.workers: dict[int, Process] = {}  # rank 0 of each replica
        self.procs: dict[tuple[int, int], Process] = {}  # every (replica, rank)
        self.incarnations: dict[int, int] = {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        self.preempt = threading.Event()  # set: the job is preempted (SIGTERM to the launcher)

    def start_coordinator(self, port: int, recover: bool = False) -> Process:
        """Start the coordinator (again, with `recover`: at the same address) and wait for its
        port."""
        cfg, out = self.cfg, self.out
        port_file, failed = out / rundir.COORDINATOR_PORT, out / rundir.COORDINATOR_FAILED
        port_file.unlink(missing_ok=True)
        failed.unlink(missing_ok=True)
        coord = CoordinatorConfig.from_fault_tolerance(
            cfg.ft.to_library(), cfg.layout.replicas, host=self.host, port=port,
            port_file=str(port_file), store_shards=cfg.ft.store_shards,
            log_path=str(out / rundir.COORDINATOR_LOG),
            stats_path=str(out / rundir.STORE_STATS),
            # RECOVER_RUN_TOKEN, when set, is the run's token (runtoken.run_token) and no file
            # is written: the coordinator reads the same variable from its environment.
            token_file=None if LaunchEnv.from_env().token else str(out / rundir.RUN_TOKEN),
            fingerprint=fingerprint(cfg), recover=recover, liveness_port=0 if recover else None)
        proc = self.coord = self.spawner.start("recover.control.coordinator:main",
                                               coord.to_argv(),
                                               out / rundir.LOGS / rundir.COORDINATOR_OUT)
        # The port file, the coordinator's exit or 60 s, whichever comes first.
        poll_until(lambda: port_file.exists() or proc.poll() is not None, 60.0, 0.05)
        if not port_file.exists():
            stop_all([proc])
            why = _coordinator_error(out / rundir.LOGS / rundir.COORDINATOR_OUT)
            line = (f"the coordinator did not start{f' ({why})' if why else ''}; see "
                    f"{out / rundir.LOGS / rundir.COORDINATOR_OUT}")
            # Workers a scheduler started beside it wait for DIR/coordinator.port; this tells
            # them to stop waiting (recover.app.train.worker) instead of dialling the port.
            # Best effort: the error below is what the launcher reports either way.
            with contextlib.suppress(OSError):
                write_atomic(failed, line + "\n")
            raise RecoverError(line)
        self.port = int(port_file.read_text())
        log.debug("coordinator (pid %d) on port %d", proc.pid, self.port)
        return proc

    def start_replica(self, r: int, join_at: int = 0) -> None:
        """All ranks of replica r; again after a `restart` fault (a new incarnation, which joins
        the running job at a step boundary >= join_at: recover.replica.rejoin)."""
        inc = self.incarnations[r] = self.incarnations.get(r, -1) + 1
        for k in range(self.cfg.layout.ranks_per_replica()):  # multi-rank: a process per rank
            name = rundir.replica_log(r, k)
            self.procs[(r, k)] = self.spawner.start(
                "recover.app.train.worker:main",
                ["--run-dir", str(self.out), "--replica", str(r), "--rank", str(k),
                 "--coordinator", f"127.0.0.1:{self.port}"], self.out / rundir.LOGS / name,
                env={**self.env, "RECOVER_INCARNATION": str(inc),
                     "RECOVER_JOIN_AT": str(join_at)})
            log.debug("replica %d rank %d (incarnation %d): pid %d", r, k, inc,
                      self.procs[(r, k)].pid)
        self.workers[r] = self.procs[(r, 0)]

    def run(self, console: Console, quiet: bool, external: bool, port: int,
            make_watch: Callable[[dict[int, Process]], Watch] | None) -> RunResult:
        """Start the processes, supervise them to the end, end them; what happened."""
        cfg = self.cfg
        coord = self.start_coordinator(port)
        sink: MetricsSink | None = None
        try:
            store = connect_store("127.0.0.1", self.port, 30.0)
            for r in range(0 if external else cfg.layout.replicas):
                self.start_replica(r)
            watch = make_watch(self.workers) if make_watch is not None else None
            if not quiet:
                say(console, f"recover: {cfg.layout.replicas} replicas, "
                             f"N={cfg.data.microbatches} microbatches x "
                             f"{cfg.data.microbatch_size} x {cfg.model.block_size} tokens, "
                             f"model {cfg.model.name}, steps {self.start}..{self.end - 1}, "
                             f"out {self.out}")
            # Opened while the replicas start (W&B's service takes a moment); the records wait
            # in the store meanwhile.
            writers, where = open_writers(cfg, self.start)
            for line in where if not quiet else []:
                say(console, f"recover: {line}")
            tokens = cfg.data.microbatches * cfg.data.microbatch_size * cfg.model.block_size
            sink = MetricsSink(store, self.out / rundir.METRICS, self.start, self.end, tokens,
                               self.t_start, ProgressView(console, self.start, self.end, quiet,
                                                          cfg.run.log_every), writers,
                               token=_records_token(self.out))
            message = self.supervise(sink, external, console, quiet)
            if watch is not None:
                watch.stop()
            message, seen = self.wind_down(sink.store, external, message)
        finally:
            if sink is not None:
                sink.close()
            # SIGKILL: a replica that is still running here is ended as SIGTERM's default action
            # ended it before it meant "preempted, leave at the next step boundary".
            stop_all(list(self.procs.values()), sig=signal.SIGKILL)
            stop_all([p for p in (coord, self.coord) if p is not None])
        assert sink is not None  # made, or the exception above went on
        return self.result(sink, message, seen, watch, console, quiet)

    def supervise(self, sink: MetricsSink, external: bool, console: Console,
                  quiet: bool) -> str:
        """Write records until the last step or until the run cannot go on; restart a coordinator
        that died (`--coordinator-restarts`) at its address. Returns why it stopped ("": done)."""
        ft = self.cfg.ft
        restarts = {f.replica: f.step for f in self.faults if f.kind == "restart"}
        stall_limit = ft.join_timeout_s + ft.reduce_timeout_s + 60
        coord_restarts = ft.coordinator_restarts if ft.coordinator_wait_s > 0 else 0
        while True:
            try:
                why = supervision.supervise(sink.store, sink, self.end, self.procs, external,
                                            stall_limit, restarts, self.start_replica,
                                            self.preempt)
                return self.preempt_job(sink) if self.preempt.is_set() else why
            except Exception as e:  # the store is gone: the coordinator process died
                assert self.coord is not None
                if wait_exit(self.coord, 5.0) is None:
                    raise
                why = (f"the coordinator died (exit code {self.coord.returncode}) at step "
                       f"{sink.next}: {str(e).splitlines()[0][:120]}")
                if coord_restarts <= 0:
                    return f"{why}; replicas checkpoint and stop"
                # Same address: the replicas, which kept their state, re-register with it and
                # the run resumes from their last committed step (recover.control.membership).
                coord_restarts -= 1
                if not quiet:
                    say(console, f"recover: {why}; restarting it (--recover)")
                sink.note("events/coordinator", f"{why}; restarted (--recover)")
                self.start_coordinator(self.port, recover=True)
                sink.store = connect_store("127.0.0.1", self.port, 30.0)

    def preempt_job(self, sink: MetricsSink) -> str:
        """The job is preempted: tell the replicas that the whole job goes (the leader then
        checkpoints the last committed step; recover.app.train.loop), pass the SIGTERM on to
        every process, and write records until they have left, within the grace period (the
        launcher keeps a tenth of it to end what is left and write the exit records)."""
        deadline = Deadline(0.9 * self.cfg.ft.preempt_grace_s)
        with contextlib.suppress(Exception):  # the coordinator is gone: nobody to tell
            sink.store.set(keys.JOB_PREEMPTED, "1")
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        while not deadline.passed() and any(p.poll() is None for p in self.procs.values()):
            if not sink.poll():
                time.sleep(0.02)
        sink.poll()
        return f"preempted (SIGTERM) after step {sink.next - 1}"

    def wind_down(self, store: Any, external: bool, message: str) -> tuple[str, dict[int, str]]:
        """Let survivors write the final checkpoint and leave (hung or fenced ones are ended
        after); read why the run stopped and how the coordinator saw each replica leave."""
        hang_s = max([f.seconds for f in self.faults if f.kind == "hang"] or [0.0])
        assert self.coord is not None
        supervision.await_leaving(store, self.coord, self.procs, external,
                                  (self.cfg.ft.join_timeout_s if external else 30) + hang_s)
        seen: dict[int, str] = {}
        if self.coord.poll() is None:
            stopped = try_get(store, keys.RUN_STOPPED)
            if stopped is not None:
                message = supervision.said(stopped)
            with contextlib.suppress(Exception):
                raw = try_get(store, keys.COORD_EXITS)
                seen = {int(r): how for r, how in json.loads(raw or b"{}").items()}
        return message, seen

    def result(self, sink: MetricsSink, message: str, seen: dict[int, str],
               watch: Watch | None, console: Console, quiet: bool) -> RunResult:
        """The run's outcome, with each process's exit code (also written to DIR)."""
        out, cfg = self.out, self.cfg
        codes = {r: p.returncode for r, p in self.workers.items()}
        # "replica1.rank0", not "1.0": a key that reads as a number (a float) misleads readers.
        rank_codes = {f"replica{r}.rank{k}": p.returncode for (r, k), p in self.procs.items()}
        if self.procs:  # who exited how: a fenced rank (3) left on its own, before the cleanup
            _write_report(out / rundir.EXIT_CODES, json.dumps(rank_codes) + "\n", console)
        exits = supervision.describe_exits(cfg.layout.replicas, codes, seen)
        _write_report(out / rundir.REPLICA_EXITS,
                      json.dumps({str(r): e for r, e in exits.items()}, indent=1) + "\n", console)
        ok = sink.next >= self.end
        if self.preempt.is_set() and not ok:
            message = f"{message}; {supervision.checkpoint_note(out)}"
        if not ok and not message:
            shown = codes if cfg.layout.ranks_per_replica() == 1 else rank_codes
            how = (str({r: supervision.meaning_or_code(c) for r, c in shown.items()}) if shown
                   else "; ".join(f"{r}: {e}" for r, e in exits.items()))
            message = (f"training stopped at step {sink.next}: replica exits {how}; see "
                       f"{out / 'logs'}")
        if not quiet and exits:
            say(console, "replica exits: " + "; ".join(f"{r}: {e}" for r, e in exits.items()))
        aborted = watch.lost if watch is not None else []
        if aborted:
            message = (f"replica(s) {aborted} exited abnormally at step {sink.next}; the job was "
                       f"torn down (the launch's watch, {type(watch).__name__})")
        return RunResult(ok, out, sink.records, message, codes, time.time() - self.t_start,
                         aborted, watch.t if watch is not None else 0.0, self.t_start,
                         rank_codes, exits, self.preempt.is_set() and not ok)


def _laid_out(cfg: RunConfig | CheckedConfig, console: Console) -> PreparedRun:
    """`prepare_run`, and metrics.jsonl cut back for a resume: a file system that refuses these
    first writes (full, read-only) is one line before any process starts, not a traceback."""
    try:
        prepared = prepare_run(cfg, console)
        truncate_metrics(Path(prepared.cfg.run.out) / rundir.METRICS, prepared.start)
    except OSError as e:
        out = (cfg.cfg if isinstance(cfg, CheckedConfig) else cfg).run.out
        where = f" ({e.filename})" if e.filename else ""
        raise RecoverError(f"cannot write the run directory {out}{where}: "
                           f"{e.strerror or e}") from None
    return prepared


def _records_token(out: Path) -> str | None:
    """The key the replicas seal their step records with (the run token: DIR/run.token or the
    env, as `prepare_run` left it); the metrics sink ignores any record it does not open."""
    return run_token(out).decode()


def _write_report(path: Path, text: str, console: Console) -> None:
    """One of the launcher's end-of-run files; a file system that refuses it (full, read-only)
    costs one console line, never the run's result."""
    try:
        write_atomic(path, text)
    except OSError as e:
        say(console, f"recover: cannot write {path} ({e.strerror or e}); the run's result "
                     "is unchanged")
