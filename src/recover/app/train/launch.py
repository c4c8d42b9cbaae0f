"""`recover train` on one machine: a coordinator process, R replica processes, a metrics sink.

Invariant: the launcher never kills a survivor because another replica died; it only reads the
step records, and ends processes (by PID, through their handles) once the run is over or cannot go
on. Every wait is bounded. User mistakes are caught here, before any process starts, as one-line
RecoverErrors. Processes are started by `recover.procs.Spawner` (forked by the standard library's
fork server, which imports torch once for the whole launch, not once per process; plain
subprocesses with `RECOVER_FORKSERVER=0`), and every one of them is ended by PID when the launch
ends, whatever happened. What a user reads (the run's header, how replicas exited, a coordinator
restart, what `--resume` chose) goes to the console the CLI passes in; the rest to logging. The
metrics sink's progress view and writers (TensorBoard, W&B) are closed before the processes are
ended, whatever happened. The launcher lifts its open-files limit to the hard one; a file system
that refuses its writes costs a console line (metrics.jsonl's: held and retried), never the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from recover.app.config import RunConfig, fingerprint, flatten
from recover.app.endpoint import HttpConfig, serve
from recover.app.faults import validate_faults
from recover.app.runtoken import resume_token, run_token
from recover.app.train import foreign
from recover.app.train.ckpt_files import write_atomic
from recover.app.train.data import check_token_ids, load_data, prepare_data
from recover.app.train.metrics import MetricsSink, truncate_metrics
from recover.app.train.progress import ProgressView
from recover.app.train.worker import COORDINATOR_FAILED, COORDINATOR_PORT
from recover.app.train.writers import check as check_writers
from recover.app.train.writers import open_writers
from recover.collectives import CoordinatorConfig, connect_store, keys, try_get
from recover.collectives.coordinator import raise_descriptor_limit
from recover.errors import CheckpointError, ConfigError, ExitCode, RecoverError
from recover.procs import Process, Spawner, stop_all, wait_exit
from recover.settings import LaunchEnv

log = logging.getLogger(__name__)

MAX_REASON = 500  # bytes of a stop reason read from the store that the launcher shows
# After the last replica process exits, how long the launcher waits for the coordinator to have
# taken every replica off the membership (ms on a quiet machine) before it reads the exit records.
SETTLE_S = 2.0
# What the launch's processes import, once, in the fork server: the replica's and the
# coordinator's entry points, the training loop and the parallel layouts; and what torch imports
# lazily later: torch._dynamo (AdamW's constructor imports it, 2.6 CPU-s in every replica) and
# torch.distributed.checkpoint (the leader's first save, 2.6 CPU-s cold). Measured: an R=4 launch
# 11.2 -> 7.9 CPU-s (docs/MEASUREMENTS.md, "Threads and start-up").
PRELOAD = ("recover.app.train.worker", "recover.collectives.coordinator",
           "recover.app.train.loop", "recover.parallel", "torch._dynamo",
           "torch.distributed.checkpoint")


@dataclass
class RunResult:
    ok: bool
    out: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    exit_codes: dict[int, int | None] = field(default_factory=dict)  # rank 0 of each replica
    wall_s: float = 0.0
    # With abort_on_loss (the ckpt-restart baseline): the replicas whose abnormal exit made the
    # launcher end the job, and when it saw that (time.time()); t_start is the base of `time_s`.
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


def exit_meaning(code: int) -> str | None:
    """A process's exit code in words: its `ExitCode`, or the signal that ended it."""
    with contextlib.suppress(ValueError):
        return ExitCode(code).meaning
    with contextlib.suppress(ValueError):
        if code < 0:
            return f"killed ({signal.Signals(-code).name})"
    return None


def prepare_run(cfg: RunConfig, console: Console | None = None) -> tuple[RunConfig, int]:
    """Validate, lay out DIR, prepare data, write config.json; return (cfg, first step).
    `console`: where `--resume` says what it chose (default: stderr)."""
    cfg.validate()
    validate_faults(cfg.ft.faults, cfg.layout.replicas, cfg.run.steps,
                    cfg.layout.ranks_per_replica())
    check_writers(cfg)  # an explicit --tensorboard/--wandb whose package is missing
    foreign.resolve(cfg.model)  # what the model is: compared on --resume, in the fingerprint
    out = Path(cfg.run.out)
    start = 0
    if cfg.run.resume:
        start = _resume_point(cfg, out, console or Console(stderr=True))
    elif (out / "metrics.jsonl").exists() or _holds_files(out / "ckpt"):
        # An empty DIR/ckpt is not a run: it may be a volume mounted there for the checkpoints.
        raise ConfigError(f"{out} already holds a run; use --resume to continue it or choose "
                          "another --out")
    out.mkdir(parents=True, exist_ok=True)
    run_token(out, create=True)  # the key of the run's checkpoint manifests (DIR/run.token)
    (out / "logs").mkdir(exist_ok=True)
    meta = prepare_data(cfg.data.path, out / "data", cfg.data.val_fraction, cfg.model.block_size)
    if meta["vocab_size"] > cfg.model.vocab_size:
        cfg.model.vocab_size = int(meta["vocab_size"])
    foreign.check_fits(cfg.model, int(meta["vocab_size"]))
    check_token_ids(load_data(out / "data"), cfg.model.vocab_size)
    tmp = out / "config.json.tmp"
    tmp.write_text(cfg.to_json())
    os.replace(tmp, out / "config.json")
    return cfg, start


def _coordinator_error(log_file: Path) -> str:
    """The coordinator's own one-line reason for not starting (its last "cannot start" line)."""
    with contextlib.suppress(OSError):
        for line in reversed(log_file.read_text(errors="replace").splitlines()):
            if "recover coordinator: " in line:
                return line.split("recover coordinator: ", 1)[1].strip()
    return ""


def _holds_files(folder: Path) -> bool:
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def _resume_point(cfg: RunConfig, out: Path, console: Console) -> int:
    """The step `--resume` continues from: the newest checkpoint that verifies, if the settings
    and the layout match the saved run. Says which checkpoint and why newer ones were skipped."""
    from recover.app.train.checkpoint import check_layout
    from recover.app.train.ckpt_files import find_latest, read_manifest
    from recover.app.train.ckpt_rank import layout_of

    if not (out / "ckpt").is_dir():
        raise CheckpointError(f"--resume: no checkpoint found in {out / 'ckpt'}")
    key = resume_token(out)  # never a new one: it would authenticate none of the run's files
    ckpt, skipped = find_latest(out / "ckpt", key)
    for line in skipped:
        _say(console, f"recover: --resume {line}")
    if ckpt is None:
        raise CheckpointError(f"--resume: no checkpoint found in {out / 'ckpt'}"
                              + (" that verifies" if skipped else ""))
    _refuse_code_in(ckpt)
    saved = RunConfig.load(out / "config.json")
    old, new = flatten(saved.trajectory_key()), flatten(cfg.trajectory_key())
    # The vocabulary grows to fit the data when it is prepared (below), after this check.
    new["model.vocab_size"] = old.get("model.vocab_size", new["model.vocab_size"])
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if diff:
        raise ConfigError(f"--resume: settings differ from the saved run in {out}: "
                          f"{', '.join(diff)} (a resumed run must keep its trajectory; "
                          "--steps is the LR schedule's horizon)")
    meta = read_manifest(ckpt, key)  # authenticated; its files were verified by find_latest
    check_layout(ckpt, meta, layout_of(cfg))
    start = int(meta["step"])
    if start >= cfg.run.steps:
        raise ConfigError(f"--resume: the run in {out} already completed all {start} steps")
    if 0 < cfg.run.stop_at <= start:
        raise ConfigError(f"--resume: --stop-at {cfg.run.stop_at} is not after step {start}, "
                          f"where the run would continue ({ckpt.name}): nothing would be "
                          "trained (give a later --stop-at, or none)")
    _say(console, f"recover: --resume from {ckpt.name} (step {start})"
         + (f", skipping {len(skipped)} newer that did not verify" if skipped else ""))
    return start


def _refuse_code_in(ckpt: Path) -> None:
    """--resume reads the checkpoint's DCP metadata (a pickle) here, by the unpickler that builds
    nothing but DCP's records (`checkpoint_safe`), so one naming anything else is refused in one
    line before any process starts: its HMAC, keyed by the directory's own token, proves nothing
    about a directory someone else wrote."""
    from recover.app.train.checkpoint_safe import read_metadata

    read_metadata(ckpt)


def _say(console: Console, line: str) -> None:
    """One line of `recover train`'s own output, as written (no markup, no wrapping). A console
    whose file refuses it (a full disk under a scheduler's output file, a closed pipe) loses the
    line, never the run."""
    try:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    except OSError as e:
        log.debug("console line lost (%s): %s", e.strerror or e, line)


def launch(cfg: RunConfig, console: Console | None = None, quiet: bool = False,
           external_workers: bool = False, port: int = 0,
           abort_on_loss: bool = False, host: str | None = None,
           http: HttpConfig | None = None, preempt: threading.Event | None = None) -> RunResult:
    """Run training to the end (or until it cannot go on) and return what happened.

    With `external_workers`, no replica is started here: they are launched elsewhere (one
    `torchrun` per replica, pointed at this host's `port`), and this process is the control plane
    and the metrics sink.

    With `abort_on_loss` (the checkpoint-restart baseline, not `recover train`), the first abnormal
    replica exit ends every replica by PID, as torchrun's agent does; see `RunResult.aborted`.

    `preempt`, once set (the CLI's SIGTERM handler: a scheduler preempting the job), makes the
    run stop within `--preempt-grace-s`: the leader checkpoints the last committed step, the exit
    records are written, and the result says `preempted`.
    """
    console = console or Console(stderr=True)
    raise_descriptor_limit()
    # Before the fork server starts: it then preloads what a foreign model needs (transformers),
    # imported here already, and every replica is forked with it.
    foreign.resolve(cfg.model)
    # The fork server imports torch while the run is prepared. None for external workers: the
    # coordinator is then the only local process.
    spawner = Spawner((*PRELOAD, *foreign.preload(cfg.model)),
                      fork=False if external_workers else None).warm()
    endpoint = None
    try:
        cfg, start = _laid_out(cfg, console)
        endpoint = serve(Path(cfg.run.out), http)
        t_start = time.time()
        # On disk too: `time_s` in metrics.jsonl is relative to it, and other logs
        # (coordinator.jsonl) carry absolute clocks; bench/rejoin.py lines them up.
        (Path(cfg.run.out) / "run_start").write_text(f"{t_start:.6f}\n")
        host = host or ("0.0.0.0" if external_workers else "127.0.0.1")
        run = _Launch(cfg, start, t_start, spawner, host)
        run.preempt = preempt or threading.Event()
        return run.run(console, quiet, external_workers, port, abort_on_loss)
    finally:
        if endpoint is not None:
            endpoint.close()
        spawner.close()


class _Launch:
    """One launch's processes (the coordinator, every rank of every replica) and its run."""

    def __init__(self, cfg: RunConfig, start: int, t_start: float, spawner: Spawner,
                 host: str) -> None:
        self.cfg, self.start, self.t_start = cfg, start, t_start
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
        port_file, failed = out / COORDINATOR_PORT, out / COORDINATOR_FAILED
        port_file.unlink(missing_ok=True)
        failed.unlink(missing_ok=True)
        coord = CoordinatorConfig.from_fault_tolerance(
            cfg.ft.to_library(), cfg.layout.replicas, host=self.host, port=port,
            port_file=str(port_file), store_shards=cfg.ft.store_shards,
            log_path=str(out / "coordinator.jsonl"), stats_path=str(out / "store_stats.json"),
            # RECOVER_RUN_TOKEN, when set, is the run's token (runtoken.run_token) and no file
            # is written: the coordinator reads the same variable from its environment.
            token_file=None if LaunchEnv.from_env().token else str(out / "run.token"),
            fingerprint=fingerprint(cfg), recover=recover, liveness_port=0 if recover else None)
        proc = self.coord = self.spawner.start("recover.collectives.coordinator:main",
                                               coord.to_argv(), out / "logs" / "coordinator.log")
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_all([proc])
                why = _coordinator_error(out / "logs" / "coordinator.log")
                line = (f"the coordinator did not start{f' ({why})' if why else ''}; see "
                        f"{out / 'logs'}/coordinator.log")
                # Workers a scheduler started beside it wait for DIR/coordinator.port; this tells
                # them to stop waiting (recover.app.train.worker) instead of dialling the port.
                # Best effort: the error below is what the launcher reports either way.
                with contextlib.suppress(OSError):
                    write_atomic(failed, line + "\n")
                raise RecoverError(line)
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        log.debug("coordinator (pid %d) on port %d", proc.pid, self.port)
        return proc

    def start_replica(self, r: int, join_at: int = 0) -> None:
        """All ranks of replica r; again after a `restart` fault (a new incarnation, which joins
        the running job at a step boundary >= join_at: recover.parallel.rejoin)."""
        inc = self.incarnations[r] = self.incarnations.get(r, -1) + 1
        for k in range(self.cfg.layout.ranks_per_replica()):  # multi-rank: a process per rank
            name = f"replica{r}.log" if k == 0 else f"replica{r}.rank{k}.log"
            self.procs[(r, k)] = self.spawner.start(
                "recover.app.train.worker:main",
                ["--run-dir", str(self.out), "--replica", str(r), "--rank", str(k),
                 "--coordinator", f"127.0.0.1:{self.port}"], self.out / "logs" / name,
                env={**self.env, "RECOVER_INCARNATION": str(inc),
                     "RECOVER_JOIN_AT": str(join_at)})
            log.debug("replica %d rank %d (incarnation %d): pid %d", r, k, inc,
                      self.procs[(r, k)].pid)
        self.workers[r] = self.procs[(r, 0)]

    def run(self, console: Console, quiet: bool, external: bool, port: int,
            abort_on_loss: bool) -> RunResult:
        """Start the processes, supervise them to the end, end them; what happened."""
        cfg = self.cfg
        coord = self.start_coordinator(port)
        sink: MetricsSink | None = None
        try:
            store = connect_store("127.0.0.1", self.port, 30.0)
            for r in range(0 if external else cfg.layout.replicas):
                self.start_replica(r)
            watch = _AbortWatch(self.workers) if abort_on_loss else None
            if not quiet:
                _say(console, f"recover: {cfg.layout.replicas} replicas, "
                              f"N={cfg.data.microbatches} microbatches x "
                              f"{cfg.data.microbatch_size} x {cfg.model.block_size} tokens, "
                              f"model {cfg.model.name}, steps {self.start}..{self.end - 1}, "
                              f"out {self.out}")
            # Opened while the replicas start (W&B's service takes a moment); the records wait
            # in the store meanwhile.
            writers, where = open_writers(cfg, self.start)
            for line in where if not quiet else []:
                _say(console, f"recover: {line}")
            tokens = cfg.data.microbatches * cfg.data.microbatch_size * cfg.model.block_size
            sink = MetricsSink(store, self.out / "metrics.jsonl", self.start, self.end, tokens,
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
        faults = validate_faults(ft.faults, self.cfg.layout.replicas, self.cfg.run.steps,
                                 self.cfg.layout.ranks_per_replica())
        restarts = {f.replica: f.step for f in faults if f.kind == "restart"}
        stall_limit = ft.join_timeout_s + ft.reduce_timeout_s + 60
        coord_restarts = ft.coordinator_restarts if ft.coordinator_wait_s > 0 else 0
        while True:
            try:
                why = _supervise(sink.store, sink, self.end, self.procs, external, stall_limit,
                                 restarts, self.start_replica, self.preempt)
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
                # the run resumes from their last committed step (recover.collectives.membership).
                coord_restarts -= 1
                if not quiet:
                    _say(console, f"recover: {why}; restarting it (--recover)")
                sink.note("events/coordinator", f"{why}; restarted (--recover)")
                self.start_coordinator(self.port, recover=True)
                sink.store = connect_store("127.0.0.1", self.port, 30.0)

    def preempt_job(self, sink: MetricsSink) -> str:
        """The job is preempted: tell the replicas that the whole job goes (the leader then
        checkpoints the last committed step; recover.app.train.loop), pass the SIGTERM on to
        every process, and write records until they have left, within the grace period (the
        launcher keeps a tenth of it to end what is left and write the exit records)."""
        deadline = time.monotonic() + 0.9 * self.cfg.ft.preempt_grace_s
        with contextlib.suppress(Exception):  # the coordinator is gone: nobody to tell
            sink.store.set(keys.JOB_PREEMPTED, "1")
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            if not sink.poll():
                time.sleep(0.02)
        sink.poll()
        return f"preempted (SIGTERM) after step {sink.next - 1}"

    def wind_down(self, store: Any, external: bool, message: str) -> tuple[str, dict[int, str]]:
        """Let survivors write the final checkpoint and leave (hung or fenced ones are ended
        after); read why the run stopped and how the coordinator saw each replica leave."""
        hang_s = max([float(s.split("seconds=")[1].split(",")[0]) for s in self.cfg.ft.faults
                      if "seconds=" in s] or [0.0])
        assert self.coord is not None
        _await_leaving(store, self.coord, self.procs, external,
                       (self.cfg.ft.join_timeout_s if external else 30) + hang_s)
        seen: dict[int, str] = {}
        if self.coord.poll() is None:
            stopped = try_get(store, keys.RUN_STOPPED)
            if stopped is not None:
                message = _said(stopped)
            with contextlib.suppress(Exception):
                raw = try_get(store, keys.COORD_EXITS)
                seen = {int(r): how for r, how in json.loads(raw or b"{}").items()}
        return message, seen

    def result(self, sink: MetricsSink, message: str, seen: dict[int, str],
               watch: _AbortWatch | None, console: Console, quiet: bool) -> RunResult:
        """The run's outcome, with each process's exit code (also written to DIR)."""
        out, cfg = self.out, self.cfg
        codes = {r: p.returncode for r, p in self.workers.items()}
        # "replica1.rank0", not "1.0": a key that reads as a number (a float) misleads readers.
        rank_codes = {f"replica{r}.rank{k}": p.returncode for (r, k), p in self.procs.items()}
        if self.procs:  # who exited how: a fenced rank (3) left on its own, before the cleanup
            _write_report(out / "exit_codes.json", json.dumps(rank_codes) + "\n", console)
        exits = _describe_exits(cfg.layout.replicas, codes, seen)
        _write_report(out / "replica_exits.json",
                      json.dumps({str(r): e for r, e in exits.items()}, indent=1) + "\n", console)
        ok = sink.next >= self.end
        if self.preempt.is_set() and not ok:
            message = f"{message}; {_checkpoint_note(out)}"
        if not ok and not message:
            shown = codes if cfg.layout.ranks_per_replica() == 1 else rank_codes
            how = (str({r: _meaning_or_code(c) for r, c in shown.items()}) if shown else
                   "; ".join(f"{r}: {e}" for r, e in exits.items()))
            message = (f"training stopped at step {sink.next}: replica exits {how}; see "
                       f"{out / 'logs'}")
        if not quiet and exits:
            _say(console, "replica exits: " + "; ".join(f"{r}: {e}" for r, e in exits.items()))
        aborted = watch.lost if watch is not None else []
        if aborted:
            message = (f"replica(s) {aborted} exited abnormally at step {sink.next}; the job was "
                       "torn down (abort_on_loss)")
        return RunResult(ok, out, sink.records, message, codes, time.time() - self.t_start,
                         aborted, watch.t if watch is not None else 0.0, self.t_start,
                         rank_codes, exits, self.preempt.is_set() and not ok)


def _laid_out(cfg: RunConfig, console: Console) -> tuple[RunConfig, int]:
    """`prepare_run`, and metrics.jsonl cut back for a resume: a file system that refuses these
    first writes (full, read-only) is one line before any process starts, not a traceback."""
    try:
        cfg, start = prepare_run(cfg, console)
        truncate_metrics(Path(cfg.run.out) / "metrics.jsonl", start)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise RecoverError(f"cannot write the run directory {cfg.run.out}{where}: "
                           f"{e.strerror or e}") from None
    return cfg, start


def _said(raw: bytes) -> str:
    """A reason read from the store (`run/stopped`: any client can write it), as printable text
    of bounded length: never a decoding error at the run's end."""
    text = " ".join(raw[:MAX_REASON].decode(errors="replace").split())
    return text + ("..." if len(raw) > MAX_REASON else "")


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
        _say(console, f"recover: cannot write {path} ({e.strerror or e}); the run's result "
                      "is unchanged")


def _checkpoint_note(out: Path) -> str:
    """Where `--resume` would continue a preempted run from, in words."""
    from recover.app.train.ckpt_files import find_latest

    with contextlib.suppress(Exception):  # no token, no folder: said below
        ckpt, _ = find_latest(out / "ckpt", resume_token(out))
        if ckpt is not None:
            return f"checkpoint {ckpt.name}; continue with --resume"
    return f"no checkpoint in {out / 'ckpt'}"


def _meaning_or_code(code: int | None) -> str | int | None:
    return code if code is None else (exit_meaning(code) or code)


def _all_gone(store: Any, workers: dict[int, Process], external: bool) -> bool:
    """Every replica has exited (local children) or left the membership (external ones)."""
    if not external:
        return all(p.poll() is not None for p in workers.values())
    try:
        return keys.newest_members(store) == []
    except (ValueError, TypeError):  # not a member list (a stranger's value): not known empty
        return False


def _await_leaving(store: Any, coord: Process, procs: dict[tuple[int, int], Process],
                   external: bool, limit_s: float) -> None:
    """Wait (bounded) until every replica has left: local processes exit; external ones leave
    the membership. The coordinator must outlive them: a replica still finishing its last step
    (the leader's final checkpoint) needs the store, and would otherwise end as if it failed."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not external:
            if all(p.poll() is not None for p in procs.values()):
                # Their last words (a bye, a closed liveness socket) reach the coordinator just
                # after they exit: let it take them all off the membership first, or the exit
                # records read its view from before (a preempted replica read as "running").
                _await_no_members(store, coord, min(deadline, time.monotonic() + SETTLE_S))
                return
        elif coord.poll() is not None:
            return
        else:
            try:
                if keys.store_int(store, keys.GEN_COUNT) == 0 or _all_gone(store, {}, True):
                    return  # nobody joined, or every member left or was dropped
            except Exception:  # the store went away with the coordinator
                return
        time.sleep(0.05)


def _await_no_members(store: Any, coord: Process, until: float) -> None:
    """Wait until the coordinator's newest generation is empty (or it is gone), until `until`."""
    while time.monotonic() < until and coord.poll() is None:
        try:
            if keys.newest_members(store) == []:
                return
        except Exception:  # the store went away with the coordinator
            return
        time.sleep(0.02)


def _describe_exits(replicas: int, codes: dict[int, int | None],
                    seen: dict[int, str]) -> dict[int, str]:
    """One phrase per replica: its exit code (if started here) and the coordinator's view."""
    out: dict[int, str] = {}
    for r in range(replicas):
        parts = []
        if r in codes:
            c = codes[r]
            # A preempted replica exits 0 too (a planned leave): not "finished".
            left = "preempted" if c == 0 and "(preempted)" in seen.get(r, "") else None
            parts.append("still running (ended by the launcher)" if c is None else
                         f"exit {c} ({left or exit_meaning(c) or 'error'})")
        if r in seen:
            parts.append(f"coordinator: {seen[r]}")
        out[r] = ", ".join(parts) or "never joined"
    return out


class _AbortWatch:
    """abort_on_loss: once a replica exits abnormally, end every replica by PID (torchrun-style)."""

    def __init__(self, workers: dict[int, Process], poll_s: float = 0.005) -> None:
        self.workers, self.poll_s = workers, poll_s
        self.lost: list[int] = []
        self.t = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recover-abort", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            bad = [r for r, p in self.workers.items() if p.poll() not in (None, 0)]
            if bad:
                self.t, self.lost = time.time(), bad
                # SIGKILL: what torchrun's SIGTERM did to a replica before a replica's SIGTERM
                # meant "preempted: leave at the next step boundary".
                stop_all(list(self.workers.values()), sig=signal.SIGKILL)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _supervise(store: Any, sink: MetricsSink, end: int, procs: dict[tuple[int, int], Process],
               external: bool, stall_limit: float, restarts: dict[int, int] | None = None,
               restart: Any = None, preempt: threading.Event | None = None) -> str:
    """Write records as they arrive until the last step, or until the run cannot go on; start a
    replica again once step S-1 committed for a `restart:replica=R,step=S` fault (if it died).
    A fault is removed from `restarts` once done: supervising again after a coordinator restart
    must not restart a replica that has since finished (the last line waits for the final save)."""
    last_progress = time.monotonic()
    restarts = {} if restarts is None else restarts
    while sink.next < end and not (preempt is not None and preempt.is_set()):
        for r, at in list(restarts.items()):
            # Started again as soon as it is gone (a replacement takes seconds to start); it is
            # admitted at the first step boundary >= `at` after it registered.
            ranks = [p for (rr, _), p in procs.items() if rr == r]
            if all(p.poll() is not None for p in ranks):
                del restarts[r]
                restart(r, at)
                last_progress = time.monotonic()
        workers = dict(enumerate(procs.values()))
        if sink.poll():
            last_progress = time.monotonic()
            continue
        if _all_gone(store, workers, external):
            # Nobody can offer a record any more: the last save point's line is taken even
            # from a replica that did not write (its writer was killed after the commit).
            sink.poll(final=True)
            return ""
        stopped = try_get(store, keys.RUN_STOPPED)
        if stopped is not None and all(p.poll() is not None for p in workers.values()):
            return _said(stopped)
        if time.monotonic() - last_progress > stall_limit:
            return f"no step committed for {stall_limit:.0f}s"
        time.sleep(0.02)
    return ""
