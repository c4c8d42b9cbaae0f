"""Start and stop child processes by PID: SIGCONT, SIGTERM, a grace period, SIGKILL.

Invariants:
- A process is only ever signalled by its own PID, never by name or process group, and only
  while it is known to exist: a `Popen` child until it has been reaped (the kernel cannot reuse a
  PID before its parent reaps it); a process a `Spawner` forked through a pidfd it opened on
  itself (a pidfd names one process for good: once that process is gone a signal fails, it never
  reaches whoever got the PID next); a foreign PID (a descendant found in /proc) only while /proc
  shows it alive and not a zombie.
- Every wait is bounded. `stop` sends SIGCONT before SIGTERM: a stopped process (SIGSTOP: a hang
  fault) that handles SIGTERM cannot run its handler until it is continued, so without SIGCONT
  every such stop would sit out the whole grace period and end in SIGKILL, skipping its cleanup.
- Output goes to files, never to pipes: a pipe nobody reads fills up and blocks the child.
- A `Spawner` runs each Python entry point ("module:function", called with its argv) in a real,
  separate process (its own PID, sockets and memory: a SIGKILL of it is a real crash and closes
  its sockets), forked by the standard library's fork server (`multiprocessing`'s "forkserver"
  start method) once that server imported `preload`: every recover process imports torch
  (seconds of CPU: docs/MEASUREMENTS.md, "Threads and start-up"), which R + 1 fresh interpreters
  would each pay. The child starts as a fresh
  interpreter would: default signal handlers (SIGINT raises KeyboardInterrupt; SIGPIPE and
  SIGXFSZ ignored), an empty signal mask, stdin from /dev/null, stdout/stderr appended to its own
  files, the request's environment and working directory, and no descriptor of the server, the
  spawner or another child (but the multiprocessing resource tracker's, which multiprocessing
  itself would write to). It ends with `os._exit` (no interpreter teardown) and its exit status
  reads as Popen's (-9 for SIGKILL). A spawner's children never outlive it: `close()`, and the
  interpreter's exit, end them by PID; if the spawning process dies abruptly, the fork server
  exits (no child holds its "alive" pipe) and its children get SIGKILL (PR_SET_PDEATHSIG).
  Linux only (pidfds, prctl); elsewhere, with `RECOVER_FORKSERVER=0`, or with `fork=False`, a
  spawner starts `python -m module argv` subprocesses instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from recover.deadline import Deadline, poll_until

log = logging.getLogger(__name__)

# How long to wait for the kernel to reap a process after SIGKILL (it cannot ignore it; only a
# process stuck in uninterruptible I/O takes longer).
KILL_WAIT_S = 10.0
# How long a fork may take to report its child set up: the fork server imports `preload` (torch)
# before its first fork, which on a heavily loaded host takes many times its idle cost.
START_TIMEOUT_S = 120.0
PR_SET_PDEATHSIG = 1
# multiprocessing polls its children from any thread that starts one, and a poll that loses a
# race for the fork server's exit report reads EOF and records 255: every start and every poll
# of a forked child takes this lock.
_MP_LOCK = threading.RLock()


class Process(Protocol):
    """What callers need of a started process: `subprocess.Popen` and `Forked` both are one."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def start(cmd: Sequence[str], stdout: Path | None = None, stderr: Path | None = None, *,
          env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
          new_session: bool = True) -> subprocess.Popen:
    """Start `cmd` with stdin from /dev/null and output appended to files (stderr=None: to stdout).

    `new_session` keeps a signal meant for the caller's terminal or process group (Ctrl-C) from
    reaching the child.
    """
    out = open(stdout, "ab") if stdout is not None else subprocess.DEVNULL
    err = open(stderr, "ab") if stderr is not None else subprocess.STDOUT
    try:
        return subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=None if env is None else dict(env), cwd=cwd,
                                start_new_session=new_session)
    finally:  # the child holds its own copies of the descriptors
        for f in (out, err):
            if not isinstance(f, int):
                f.close()


def _signal(proc: Process, sig: int) -> None:
    if proc.poll() is None:  # not reaped yet: the PID (or pidfd) is still this child's
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def wait_exit(proc: Process, timeout_s: float) -> int | None:
    """`proc`'s exit code if it exits within `timeout_s`, else None (it still runs)."""
    try:
        return proc.wait(timeout=max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
        return None


def stop_all(procs: Sequence[Process], grace_s: float = 5.0, sig: int = signal.SIGTERM) -> None:
    """End our children by PID: SIGCONT and `sig` to all, SIGKILL to those left after `grace_s`.

    All are signalled before any is waited for, so the grace periods run concurrently. Every
    process is reaped before this returns (or `KILL_WAIT_S` after its SIGKILL, at most).
    """
    for p in procs:
        _signal(p, signal.SIGCONT)
        _signal(p, sig)
    deadline = Deadline(grace_s)
    for p in procs:
        if wait_exit(p, deadline.left()) is None:
            _signal(p, signal.SIGKILL)
            wait_exit(p, KILL_WAIT_S)


def stop(proc: Process, grace_s: float = 5.0, sig: int = signal.SIGTERM) -> int | None:
    """End one child by PID (see `stop_all`); return its exit code (None if it outlived SIGKILL)."""
    stop_all([proc], grace_s, sig)
    return proc.poll()


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of `pid`, read from /proc (empty where /proc is missing)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            # The command name in field 2 may hold spaces and ')': split after its last ')'.
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            parent[int(d.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (exited, not yet reaped: as good as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc: trust the signal probe
        return True


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL each PID of `pids` that is still alive (processes that are not our children)."""
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


KILL_WAIT_S = 5.0  # for a SIGKILLed process to be gone (or a zombie)


def stop_pids(pids: Sequence[int], grace_s: float = 5.0, poll_s: float = 0.02) -> None:
    """End processes that are not our children (we cannot wait() for them) by PID.

    SIGCONT and SIGTERM to each live one, then SIGKILL to those still alive after `grace_s`,
    and a bounded wait (`KILL_WAIT_S`) for the kill to land: a SIGKILL is delivered
    asynchronously, and on a loaded host a process stays runnable for a moment after it. Their
    parent reaps them; a zombie counts as ended.
    """
    for pid in pids:
        if alive(pid):
            for sig in (signal.SIGCONT, signal.SIGTERM):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
    def ended() -> bool:
        return not any(alive(p) for p in pids)

    poll_until(ended, grace_s, poll_s)
    kill_pids(pids)
    poll_until(ended, KILL_WAIT_S, poll_s)


# -- forked entry points ---------------------------------------------------------------------------
def forkserver_available() -> bool:
    """Whether a `Spawner` forks here: Linux with pidfds, and not `RECOVER_FORKSERVER=0`."""
    return (os.environ.get("RECOVER_FORKSERVER", "1") != "0"
            and sys.platform.startswith("linux") and hasattr(os, "pidfd_open"))


@dataclass(frozen=True)
class Request:
    """One process to fork: `entry(arg)` with these files, environment and directory."""

    entry: str  # "module:function" (function defaults to main)
    arg: Any  # an entry point's argv (a list of str), or what `Spawner.call` passes
    stdout: str
    stderr: str
    env: dict[str, str]
    cwd: str
    new_session: bool = False


class Forked:
    """A `subprocess.Popen`-like handle of a process a `Spawner` forked. Thread-safe."""

    def __init__(self, proc: Any, pidfd: int, args: list[str]) -> None:
        self._proc, self._pidfd = proc, pidfd  # pidfd -1: it died before it was set up
        self.pid: int = proc.pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the fork server reported it (never blocks)."""
        with _MP_LOCK:
            if self.returncode is None:
                code = self._proc.exitcode
                if code is not None:
                    self.returncode = code
                    if self._pidfd >= 0:
                        os.close(self._pidfd)
                        self._pidfd = -1
                    self._proc.close()  # its status pipe: a long run forks thousands
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else Deadline(timeout)
        while self.poll() is None:
            left = 0.05 if deadline is None else min(0.05, deadline.left())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            with contextlib.suppress(ValueError):  # closed by a poll in another thread
                multiprocessing.connection.wait([self._proc.sentinel], left)  # readable: exited
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """Signal this process; a no-op once it exited (a pidfd never names another process)."""
        with _MP_LOCK:
            if self.poll() is None and self._pidfd >= 0:
                with contextlib.suppress(ProcessLookupError):  # exited, not reported yet
                    signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_SPAWNERS: weakref.WeakSet[Spawner] = weakref.WeakSet()
_SERVER_STARTED: list[bool] = []
# Set in a child a fork server forked (run_request): a process that started as a clean copy of a
# preloaded, single-threaded server, so it may fork its own server from itself.
_FORKED: list[bool] = []


class Spawner:
    """Starts entry points, forked by the standard library's fork server (see the module's
    docstring) or as `python -m module argv` subprocesses; ends the ones still running on `close()`.

    The fork server is one per process, and `preload` is read when it starts: the first spawner
    to fork in a process decides what it imports.
    """

    def __init__(self, preload: Sequence[str] = (), *, fork: bool | None = None) -> None:
        self.fork = forkserver_available() if fork is None else fork
        self.preload = ["__main__", *preload]  # __main__: children skip re-importing it
        self.children: list[Process] = []
        _SPAWNERS.add(self)

    def start(self, entry: str, argv: Sequence[str], stdout: str | Path,
              stderr: str | Path | None = None, *, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, new_session: bool = False) -> Process:
        """Start `entry` ("module:function") with `argv`, output appended to `stdout` (and
        `stderr`, default: the same file). Raises RuntimeError if the entry cannot be resolved."""
        if self.warm().fork:
            proc: Process = self._fork(Request(entry, list(argv), str(stdout),
                                               str(stderr or stdout),
                                               dict(os.environ if env is None else env),
                                               str(cwd or os.getcwd()), new_session))
        else:
            proc = start([sys.executable, "-m", entry.partition(":")[0], *argv],
                         Path(stdout), None if stderr is None else Path(stderr),
                         env=env, cwd=cwd, new_session=new_session)
        self._keep(proc)
        return proc

    def call(self, func: Callable[[Any], Any], arg: Any, stdout: str | Path,
             stderr: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> Process:
        """Fork a process that runs `func(arg)` (a module-level function; `arg` is pickled), its
        output appended to `stdout` (and `stderr`). Forked only: RuntimeError without a fork
        server."""
        if not self.warm().fork:
            raise RuntimeError("Spawner.call needs a fork server (Linux, RECOVER_FORKSERVER != 0)")
        proc = self._fork(Request(f"{func.__module__}:{func.__qualname__}", arg, str(stdout),
                                  str(stderr or stdout), dict(os.environ if env is None else env),
                                  os.getcwd()))
        self._keep(proc)
        return proc

    def _keep(self, proc: Process) -> None:
        """Remember `proc` (to end it on `close`), forgetting those that exited."""
        self.children = [p for p in self.children if p.poll() is None]
        self.children.append(proc)

    def warm(self) -> Spawner:
        """Start the fork server now: it imports `preload` while the caller goes on (the first
        `start` waits for that import to end)."""
        if self.fork:
            try:
                _ensure_server(multiprocessing.get_context("forkserver"), self.preload)
            except OSError as e:  # cannot fork or exec here: plain processes work, only slower
                log.warning("no fork server (%s); starting plain processes", e)
                self.fork = False
        return self

    def close(self, grace_s: float = 5.0) -> None:
        """End by PID every process started here that still runs (see `stop_all`)."""
        stop_all([p for p in self.children if p.poll() is None], grace_s)
        self.children.clear()

    def __enter__(self) -> Spawner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fork(self, req: Request) -> Forked:
        ctx = multiprocessing.get_context("forkserver")
        ours, theirs = socket.socketpair()
        ours.settimeout(START_TIMEOUT_S)
        proc = ctx.Process(target=run_request, args=(req, theirs), name=req.entry)
        try:
            with _MP_LOCK:
                proc.start()
            theirs.close()
            pidfd, error = _read_ack(ours)
        except (OSError, TimeoutError) as e:
            with _MP_LOCK:  # no ack in time: end it (unreported, so not reaped: its PID)
                if proc.pid is not None and proc.exitcode is None:
                    proc.kill()
            raise RuntimeError(f"could not fork {req.entry}: {e}") from e
        finally:
            ours.close()
            theirs.close()
        handle = Forked(proc, pidfd, [req.entry])
        if error:
            handle.wait(KILL_WAIT_S)
            raise RuntimeError(f"could not start {req.entry}: {error}")
        return handle


def _ensure_server(ctx: Any, preload: list[str]) -> None:
    with _MP_LOCK:
        if _SERVER_STARTED:
            return
        ctx.set_forkserver_preload(preload)
        # One thread in the server: numpy's OpenBLAS would start a thread pool as the server
        # imports it, and a fork copies only the forking thread (and whatever locks it held).
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = old or "1"
        try:
            if not _fork_server_from_here(preload):
                multiprocessing.forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["OMP_NUM_THREADS"]
        _SERVER_STARTED.append(True)
        atexit.register(_close_spawners)  # runs before multiprocessing's own exit (it joins)


def _fork_server_from_here(preload: list[str]) -> bool:
    """Start the fork server by forking this process, where that gives the server `preload`
    would: this process was itself forked from a preloaded server (as a launcher under the test
    harness is: no thread that Python cannot see, such as an OpenMP pool), every module of
    `preload` is imported already, and only this thread runs (a fork copies only the forking
    thread). The standard way execs a fresh interpreter that imports
    them again, seconds of CPU and of a test's launch (docs/MEASUREMENTS.md, "Threads and
    start-up"). False (start it the standard way) where that does not hold, or where
    multiprocessing keeps its server's state in other attributes than Python 3.11's."""
    server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
    state = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if (not _FORKED or threading.active_count() > 1 or not all(hasattr(server, a) for a in state)
            or hasattr(server, "_forkserver_authkey") or server._forkserver_pid is not None
            or any(m != "__main__" and m not in sys.modules for m in preload)):
        return False
    multiprocessing.resource_tracker.ensure_running()  # as ensure_running() does first
    address = multiprocessing.connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server exits once every holder of alive_w is gone
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w
    server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int) -> NoReturn:
    """Become the fork server (in the forked child): only stdio, the listener and the alive pipe
    stay open, as in the server the standard way starts; never returns."""
    global _MP_LOCK
    try:
        _MP_LOCK = threading.RLock()  # the parent held it while forking
        _reset_signals()
        top = max(int(f) for f in os.listdir("/proc/self/fd")) + 1
        low, high = sorted((listener_fd, alive_r))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, max(top, high + 1))
        multiprocessing.forkserver.main(listener_fd, alive_r, [], None, None)
    finally:
        os._exit(0)


def _close_spawners() -> None:
    for spawner in list(_SPAWNERS):
        spawner.close(grace_s=2.0)


def _read_ack(sock: socket.socket) -> tuple[int, str]:
    """(the child's pidfd, "") once it is set up; (-1, why) if its entry cannot be resolved;
    (-1, "") if it died before either (its exit status says how)."""
    data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    if fds:
        return fds[0], ""
    while data.startswith(b"E") and (more := sock.recv(4096)):
        data += more
    return -1, data[1:].decode(errors="replace")


# -- in the forked child ---------------------------------------------------------------------------
def run_request(req: Request, ack: socket.socket) -> NoReturn:
    """Become the requested process (runs in the fork server's child); never returns."""
    _FORKED.append(True)
    exit_after(lambda: _become(req, ack))


def exit_after(main: Callable[[], object]) -> NoReturn:
    """Run `main()`, then end this process with the status `sys.exit(main())` would give (an
    exception: its traceback, status 1), stdout and stderr flushed, without interpreter teardown:
    destroying a gloo group that a dead peer left mid-operation can block or abort the process
    (docs/MEASUREMENTS.md, "gloo on CPU"), and an aborted NCCL communicator must not be destroyed
    at all."""
    code = 1
    try:
        code = _exit_code(main())
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _become(req: Request, ack: socket.socket) -> object:
    """Set this forked child up as `req` asks, tell the spawner (its pidfd), run the entry."""
    server = os.getppid()
    if req.new_session:
        os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server died before prctl took effect
        return 1
    _reset_signals()
    _redirect(req.stdout, req.stderr)
    os.environ.clear()
    os.environ.update(req.env)
    os.chdir(req.cwd)
    try:
        func = _resolve(req.entry)
    except Exception as e:
        ack.sendall(b"E" + f"{type(e).__name__}: {e}".encode())
        raise
    pidfd = os.pidfd_open(os.getpid())
    socket.send_fds(ack, [b"K"], [pidfd])
    os.close(pidfd)
    ack.close()
    _close_inherited()
    sys.argv = [req.entry, *req.arg] if isinstance(req.arg, list) else [req.entry]
    return func(req.arg)


def _reset_signals() -> None:
    """The handlers and mask of a fresh interpreter (the fork server changed some)."""
    signal.set_wakeup_fd(-1)
    python = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
              signal.SIGXFSZ: signal.SIG_IGN}
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, python.get(sig, signal.SIG_DFL))
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _redirect(stdout: str, stderr: str) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = out if stderr == stdout else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                               0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in {null, out, err}:
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                  errors="backslashreplace")


def _close_inherited() -> None:
    """Close every descriptor above 2 but the resource tracker's: the fork server's, the
    spawner's "alive" pipe (held here, it would keep the server alive after the spawner died),
    other children's. multiprocessing keeps the tracker's number and would write to it."""
    keep = multiprocessing.resource_tracker.getfd()
    top = max(int(f) for f in os.listdir("/proc/self/fd")) + 1
    os.closerange(3, keep)
    os.closerange(keep + 1, max(top, keep + 1))


def _resolve(entry: str) -> Callable[[list[str]], Any]:
    module, _, func = entry.partition(":")
    return getattr(importlib.import_module(module), func or "main")


def _exit_code(value: object) -> int:
    """As the interpreter maps `sys.exit(value)` to an exit status."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    sys.stderr.write(f"{value}\n")
    return 1
