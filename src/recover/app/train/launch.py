"""`recover train` on one machine: a coordinator process, R replica processes, a metrics sink.

Invariant: the launcher never kills a survivor because another replica died; it only reads the
step records, and ends processes (by PID, through their handles) once the run is over or cannot go
on. Every wait is bounded. User mistakes are caught here, before any process starts, as one-line
RecoverErrors. Processes are forked by one fork server per launch (`recover.app.train.forkserver`:
torch is imported once, not once per process; the server is ended by PID when the launch ends,
whatever happened), or started as plain subprocesses where that is off (`RECOVER_FORKSERVER=0`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from recover.app.config import RunConfig, fingerprint, flatten
from recover.app.faults import validate_faults
from recover.app.runtoken import run_token
from recover.app.train import forkserver
from recover.app.train.data import prepare_data
from recover.app.train.forkserver import ForkServer, Process
from recover.app.train.metrics import MetricsSink, truncate_metrics
from recover.collectives import CoordinatorConfig, connect_store, keys, try_get
from recover.errors import CheckpointError, ConfigError, RecoverError

EXIT_MEANING = {0: "finished", 1: "error", 2: "configuration error", 3: "fenced",
                4: "below --min-replicas", 5: "coordinator lost",
                6: "partitioned (heard nothing from the coordinator)", -9: "killed (SIGKILL)"}


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
    # Every process of every replica, "replica.rank" -> exit code (multi-rank layouts: the killed
    # rank -9, its fenced siblings 3).
    rank_exit_codes: dict[str, int | None] = field(default_factory=dict)
    # How each replica ended, in words: its exit code (replicas started here) and what the
    # coordinator saw (left cleanly / lost / fenced); the only source for external workers.
    exits: dict[int, str] = field(default_factory=dict)


def prepare_run(cfg: RunConfig) -> tuple[RunConfig, int]:
    """Validate, lay out DIR, prepare data, write config.json; return (cfg, first step)."""
    cfg.validate()
    validate_faults(cfg.ft.faults, cfg.layout.replicas, cfg.run.steps,
                    cfg.layout.ranks_per_replica())
    out = Path(cfg.run.out)
    start = 0
    if cfg.run.resume:
        start = _resume_point(cfg, out)
    elif (out / "metrics.jsonl").exists() or (out / "ckpt").exists():
        raise ConfigError(f"{out} already holds a run; use --resume to continue it or choose "
                          "another --out")
    out.mkdir(parents=True, exist_ok=True)
    run_token(out, create=True)  # the key of the run's checkpoint manifests (DIR/run.token)
    (out / "logs").mkdir(exist_ok=True)
    meta = prepare_data(cfg.data.path, out / "data", cfg.data.val_fraction, cfg.model.block_size)
    if meta["vocab_size"] > cfg.model.vocab_size:
        cfg.model.vocab_size = int(meta["vocab_size"])
    tmp = out / "config.json.tmp"
    tmp.write_text(cfg.to_json())
    os.replace(tmp, out / "config.json")
    return cfg, start


def _resume_point(cfg: RunConfig, out: Path) -> int:
    """The step `--resume` continues from: the newest checkpoint that verifies, if the settings
    and the layout match the saved run. Says which checkpoint and why newer ones were skipped."""
    from recover.app.train.checkpoint import check_layout
    from recover.app.train.ckpt_files import find_latest, read_manifest
    from recover.app.train.ckpt_rank import layout_of

    if not (out / "ckpt").is_dir():
        raise CheckpointError(f"--resume: no checkpoint found in {out / 'ckpt'}")
    key = run_token(out, create=True)
    ckpt, skipped = find_latest(out / "ckpt", key)
    for line in skipped:
        print(f"recover: --resume {line}", file=sys.stderr)
    if ckpt is None:
        raise CheckpointError(f"--resume: no checkpoint found in {out / 'ckpt'}"
                              + (" that verifies" if skipped else ""))
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
    print(f"recover: --resume from {ckpt.name} (step {start})"
          + (f", skipping {len(skipped)} newer that did not verify" if skipped else ""),
          file=sys.stderr)
    return start


def _start(server: ForkServer | None, entry: str, argv: list[str], log: Path,
           env: dict[str, str] | None = None) -> Process:
    """Start one process of the run: forked by `server` if there is one, else a fresh Python."""
    if server is not None:
        return server.spawn(entry, argv, log, env=env)
    with open(log, "ab") as f:  # the child holds its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", entry.partition(":")[0], *argv],
                                stdout=f, stderr=subprocess.STDOUT, env=env)


def _start_coordinator(cfg: RunConfig, out: Path, port: int = 0,
                       server: ForkServer | None = None, host: str = "127.0.0.1",
                       recover: bool = False) -> tuple[Process, int]:
    port_file = out / "coordinator.port"
    port_file.unlink(missing_ok=True)
    coord = CoordinatorConfig(
        replicas=cfg.layout.replicas, host=host, port=port, port_file=str(port_file),
        stale_s=cfg.ft.stale_s, join_timeout_s=cfg.ft.join_timeout_s,
        store_shards=cfg.ft.store_shards, log_path=str(out / "coordinator.jsonl"),
        token_file=str(out / "run.token"), fingerprint=fingerprint(cfg), recover=recover,
        liveness_port=0 if recover else None)
    proc = _start(server, "recover.collectives.coordinator:main", coord.to_argv(),
                  out / "logs" / "coordinator.log")
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _end([proc])
            raise RecoverError(f"the coordinator did not start; see {out / 'logs'}/coordinator.log")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def _end(procs: list[Process], grace_s: float = 5.0) -> None:
    """Terminate processes by PID (through their handles): SIGCONT and SIGTERM, then SIGKILL
    after a grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)  # a stopped process handles SIGTERM only once resumed
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


def _exited(proc: Process, timeout_s: float) -> bool:
    """Whether `proc` exits within `timeout_s` (a forked child's exit is reported by its fork
    server a moment after the kernel closed its sockets)."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _all_gone(store: Any, workers: dict[int, Process], external: bool) -> bool:
    """Every replica has exited (local children) or left the membership (external ones)."""
    if not external:
        return all(p.poll() is not None for p in workers.values())
    return keys.newest_members(store) == []


def launch(cfg: RunConfig, console: Console | None = None, quiet: bool = False,
           external_workers: bool = False, port: int = 0,
           abort_on_loss: bool = False, host: str | None = None) -> RunResult:
    """Run training to the end (or until it cannot go on) and return what happened.

    With `external_workers`, no replica is started here: they are launched elsewhere (one
    `torchrun` per replica, pointed at this host's `port`), and this process is the control plane
    and the metrics sink.

    With `abort_on_loss` (the checkpoint-restart baseline, not `recover train`), the first abnormal
    replica exit ends every replica by PID, as torchrun's agent does; see `RunResult.aborted`.
    """
    console = console or Console(stderr=True)
    cfg, start = prepare_run(cfg)
    truncate_metrics(Path(cfg.run.out) / "metrics.jsonl", start)
    t_start = time.time()
    # On disk too: `time_s` in metrics.jsonl is relative to it, and other logs (coordinator.jsonl)
    # carry absolute clocks; bench/rejoin.py lines them up.
    (Path(cfg.run.out) / "run_start").write_text(f"{t_start:.6f}\n")
    # One fork server per launch: torch is imported once, not once per process. Not for external
    # workers: the coordinator is then the only local process.
    server = _fork_server(console, quiet) if not external_workers else None
    try:
        host = host or ("0.0.0.0" if external_workers else "127.0.0.1")
        return _launch(cfg, start, console, quiet, external_workers, port, abort_on_loss,
                       t_start, server, host)
    finally:
        if server is not None:
            server.close()


def _fork_server(console: Console, quiet: bool) -> ForkServer | None:
    if not forkserver.enabled():
        return None
    try:
        return ForkServer().start()
    except OSError as e:  # cannot fork/exec here: plain processes work as well, only slower
        if not quiet:
            console.print(f"recover: no fork server ({e}); starting plain processes",
                          highlight=False)
        return None


def _launch(cfg: RunConfig, start: int, console: Console, quiet: bool, external_workers: bool,
            port: int, abort_on_loss: bool, t_start: float,
            server: ForkServer | None, host: str = "127.0.0.1") -> RunResult:
    """`launch` once DIR is prepared: start the processes, supervise, end them."""
    out = Path(cfg.run.out)
    metrics = out / "metrics.jsonl"
    coord, port = _start_coordinator(cfg, out, port, server, host)
    workers: dict[int, Process] = {}  # rank 0 of each replica
    procs: dict[tuple[int, int], Process] = {}  # every (replica, rank)
    try:
        store = connect_store("127.0.0.1", port, 30.0)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        incarnations: dict[int, int] = {}

        def start_replica(r: int, join_at: int = 0) -> None:
            """All ranks of replica r; again after a `restart` fault (a new incarnation, which
            joins the running job at a step boundary >= join_at: recover.parallel.rejoin)."""
            inc = incarnations[r] = incarnations.get(r, -1) + 1
            for k in range(cfg.layout.ranks_per_replica()):  # multi-rank: a process per rank
                name = f"replica{r}.log" if k == 0 else f"replica{r}.rank{k}.log"
                procs[(r, k)] = _start(
                    server, "recover.app.train.worker:main",
                    ["--run-dir", str(out), "--replica", str(r), "--rank", str(k),
                     "--coordinator", f"127.0.0.1:{port}"], out / "logs" / name,
                    {**env, "RECOVER_INCARNATION": str(inc), "RECOVER_JOIN_AT": str(join_at)})
            workers[r] = procs[(r, 0)]

        for r in range(0 if external_workers else cfg.layout.replicas):
            start_replica(r)
        restarts = {f.replica: f.step for f in validate_faults(cfg.ft.faults, cfg.layout.replicas,
                                                               cfg.run.steps)
                    if f.kind == "restart"}
        watch = _AbortWatch(workers) if abort_on_loss else None
        end = cfg.run.stop_at or cfg.run.steps
        tokens = cfg.data.microbatches * cfg.data.microbatch_size * cfg.model.block_size
        sink = MetricsSink(store, metrics, start, end, tokens, t_start, console, quiet)
        if not quiet:
            console.print(f"recover: {cfg.layout.replicas} replicas, N={cfg.data.microbatches} "
                          f"microbatches x {cfg.data.microbatch_size} x {cfg.model.block_size} "
                          "tokens, steps "
                          f"{start}..{end - 1}, out {out}", highlight=False)
        stall_limit = cfg.ft.join_timeout_s + cfg.ft.reduce_timeout_s + 60
        coord_restarts = cfg.ft.coordinator_restarts if cfg.ft.coordinator_wait_s > 0 else 0
        while True:
            try:
                message = _supervise(store, sink, end, procs, external_workers, stall_limit,
                                     restarts, start_replica)
                break
            except Exception as e:  # the store is gone: the coordinator process died
                if not _exited(coord, 5.0):
                    raise
                why = (f"the coordinator died (exit code {coord.returncode}) at step "
                       f"{sink.next}: {str(e).splitlines()[0][:120]}")
                if coord_restarts <= 0:
                    message = f"{why}; replicas checkpoint and stop"
                    break
                # Same address: the replicas, which kept their state, re-register with it and
                # the run resumes from their last committed step (recover.collectives.coord_joins).
                coord_restarts -= 1
                if not quiet:
                    console.print(f"recover: {why}; restarting it (--recover)", highlight=False)
                coord, _ = _start_coordinator(cfg, out, port, server, host, recover=True)
                store = sink.store = connect_store("127.0.0.1", port, 30.0)
        if watch is not None:
            watch.stop()
        # Let survivors write the final checkpoint and leave; hung or fenced ones are ended.
        hang_s = max([float(s.split("seconds=")[1].split(",")[0]) for s in cfg.ft.faults
                      if "seconds=" in s] or [0.0])
        _await_leaving(store, coord, procs, external_workers,
                       (cfg.ft.join_timeout_s if external_workers else 30) + hang_s)
        seen: dict[int, str] = {}
        if coord.poll() is None:
            stopped = try_get(store, keys.RUN_STOPPED)
            if stopped is not None:
                message = stopped.decode()
            with contextlib.suppress(Exception):
                raw = try_get(store, keys.COORD_EXITS)
                seen = {int(r): how for r, how in json.loads(raw or b"{}").items()}
    finally:
        _end(list(procs.values()))
        _end([coord])
    codes = {r: p.returncode for r, p in workers.items()}
    rank_codes = {f"{r}.{k}": p.returncode for (r, k), p in procs.items()}
    if procs:  # who exited how: a fenced rank (3) left on its own, before the launcher's cleanup
        (out / "exit_codes.json").write_text(json.dumps(rank_codes) + "\n")
    exits = _describe_exits(cfg.layout.replicas, codes, seen)
    (out / "replica_exits.json").write_text(json.dumps({str(r): e for r, e in exits.items()},
                                                       indent=1) + "\n")
    ok = sink.next >= end
    if not ok and not message:
        shown = codes if cfg.layout.ranks_per_replica() == 1 else rank_codes
        how = (str({r: EXIT_MEANING.get(c, c) for r, c in shown.items()}) if shown else
               "; ".join(f"{r}: {e}" for r, e in exits.items()))
        message = f"training stopped at step {sink.next}: replica exits {how}; see {out / 'logs'}"
    if not quiet and exits:
        console.print("replica exits: " + "; ".join(f"{r}: {e}" for r, e in exits.items()),
                      highlight=False)
    aborted = watch.lost if watch is not None else []
    if aborted:
        message = (f"replica(s) {aborted} exited abnormally at step {sink.next}; the job was torn "
                   "down (abort_on_loss)")
    return RunResult(ok, out, sink.records, message, codes, time.time() - t_start, aborted,
                     watch.t if watch is not None else 0.0, t_start, rank_codes, exits)


def _await_leaving(store: Any, coord: subprocess.Popen, procs: dict[tuple[int, int],
                   Process], external: bool, limit_s: float) -> None:
    """Wait (bounded) until every replica has left: local processes exit; external ones leave
    the membership. The coordinator must outlive them: a replica still finishing its last step
    (the leader's final checkpoint) needs the store, and would otherwise end as if it failed."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not external:
            if all(p.poll() is not None for p in procs.values()):
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


def _describe_exits(replicas: int, codes: dict[int, int | None],
                    seen: dict[int, str]) -> dict[int, str]:
    """One phrase per replica: its exit code (if started here) and the coordinator's view."""
    out: dict[int, str] = {}
    for r in range(replicas):
        parts = []
        if r in codes:
            c = codes[r]
            parts.append("still running (ended by the launcher)" if c is None else
                         f"exit {c} ({EXIT_MEANING.get(c, 'error')})")
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
                _end(list(self.workers.values()))
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _supervise(store: Any, sink: MetricsSink, end: int, procs: dict[tuple[int, int], Process],
               external: bool, stall_limit: float, restarts: dict[int, int] | None = None,
               restart: Any = None) -> str:
    """Write records as they arrive until the last step, or until the run cannot go on; start a
    replica again once step S-1 committed for a `restart:replica=R,step=S` fault (if it died)."""
    last_progress = time.monotonic()
    restarts = dict(restarts or {})
    while sink.next < end:
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
            sink.poll()
            return ""
        stopped = try_get(store, keys.RUN_STOPPED)
        if stopped is not None and all(p.poll() is not None for p in workers.values()):
            return stopped.decode()
        if time.monotonic() - last_progress > stall_limit:
            return f"no step committed for {stall_limit:.0f}s"
        time.sleep(0.02)
    return ""
