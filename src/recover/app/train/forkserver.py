"""A preloaded fork server: import torch and recover's entry modules once, then fork each process.

Invariants:
- Every process started here is a real, separate process (its own PID, sockets and memory; a
  SIGKILL of it is a real crash and closes its sockets), forked by a server that has exactly one
  thread at that moment (checked through /proc before every fork; a fork is refused otherwise).
- A child starts like a fresh interpreter would: default signal handlers (SIGINT raises
  KeyboardInterrupt, SIGPIPE ignored, as Python sets them), an empty signal mask, stdin from
  /dev/null, stdout/stderr on its own files, no file descriptor of the server or its client, the
  environment and working directory of the request. It runs `module:function(argv)` and ends with
  `os._exit` (no interpreter teardown, as recover's process entry points already do).
- The server is the only reaper of its children: it reports each exit status exactly once, and it
  delivers the client's signals only to children it has not reaped yet, so a signal can never
  reach a recycled PID. Children get SIGKILL if the server dies (PR_SET_PDEATHSIG), so a lost
  server leaves no orphans; at EOF on its request pipe (the client closed it, or died) the server
  ends its remaining children by PID and exits.

Why: every recover process imports torch (~3 CPU-s); a run of R replicas paid that R+1 times.
Linux only (the thread check reads /proc, PR_SET_PDEATHSIG is Linux's); elsewhere, or with
`RECOVER_FORKSERVER=0`, `enabled()` is False and callers start plain subprocesses.

Wire protocol (JSON lines on two pipes): client -> server `{"op": "spawn", "id", "entry", "argv",
"stdout", "stderr", "env", "cwd", "session"}` and `{"op": "signal", "pid", "sig"}`; server ->
client `{"id", "pid"}` or `{"id", "error"}`, and `{"exit": pid, "code": c}` (c as Popen's
returncode: -9 for SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

# The process entry points the launcher starts; imported by the server before its first fork.
PRELOAD = ("recover.app.train.worker", "recover.collectives.coordinator")
# Imported too when present (best effort): the multi-rank training loop and torch's parallel APIs.
PRELOAD_OPTIONAL = ("recover.app.train.loop", "recover.app.train.multirank", "recover.parallel")
_PR_SET_PDEATHSIG = 1
IN_CHILD = False  # True in a process forked by a server (its heap is the server's: clean)


class Process(Protocol):
    """What the launcher needs of a started process: `subprocess.Popen` and `ForkedProcess`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def enabled() -> bool:
    """Whether processes should be forked by a server here (Linux, and not RECOVER_FORKSERVER=0)."""
    return (os.environ.get("RECOVER_FORKSERVER", "1") != "0" and hasattr(os, "fork")
            and sys.platform.startswith("linux"))


def thread_count() -> int:
    """Threads of this process, native ones included (a fork copies only the calling thread)."""
    return len(os.listdir("/proc/self/task"))


# -- the client ------------------------------------------------------------------------------------
class ForkedProcess:
    """A `subprocess.Popen`-like handle of one child of a `ForkServer`."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.pump()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.server.wait_readable(left)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """Signal the child through the server (a no-op once it exited: no PID reuse)."""
        if self.poll() is None:
            self.server.signal(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Client of one fork server process; thread-safe (the launcher polls from two threads)."""

    def __init__(self, preload: Sequence[str] = PRELOAD + PRELOAD_OPTIONAL, *,
                 answer_timeout_s: float = 120.0, stderr: int | None = None) -> None:
        self.preload = list(preload)
        self.answer_timeout_s = answer_timeout_s
        self.stderr = stderr  # where the server's own errors go (default: inherited)
        self.pid = 0
        self.forked = False  # started by forking this process (True) or as a fresh Python
        self._popen: subprocess.Popen | None = None
        self._lock = threading.RLock()
        self._buf = b""
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._exits: dict[int, int] = {}  # exits reported before their spawn answer was read
        self.lost = False  # the server went away (its children were SIGKILLed with it)

    def start(self) -> ForkServer:
        """Start the server: forked from this process when that is safe, else a fresh Python."""
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        if IN_CHILD and thread_count() == 1:
            # A process forked by a server is itself a clean, preloaded, single-threaded image:
            # forking it spares the new server its own torch import.
            pid = os.fork()
            if pid == 0:
                os.close(req_w)
                os.close(resp_r)
                _serve_forever(req_r, resp_w, self.preload)
            self.pid, self.forked = pid, True
        else:
            # OMP_NUM_THREADS=1 before torch/numpy load: OpenBLAS would start a thread pool.
            env = dict(os.environ, OMP_NUM_THREADS="1")
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "recover.app.train.forkserver", str(req_r), str(resp_w),
                 *self.preload], pass_fds=(req_r, resp_w), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=self.stderr, env=env)
            self.pid = self._popen.pid
        os.close(req_r)
        os.close(resp_w)
        self._req, self._resp = req_w, resp_r
        os.set_blocking(self._resp, False)
        return self

    def spawn(self, entry: str, argv: Sequence[str], stdout: str | Path,
              stderr: str | Path | None = None, *, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, new_session: bool = False) -> ForkedProcess:
        """Fork a child running `entry` ("module:function") with `argv`; stdout/stderr appended
        to files (stderr defaults to stdout's file). Raises RuntimeError if the server refuses."""
        with self._lock:
            self._next_id += 1
            rid = self._next_id
            self._write({"op": "spawn", "id": rid, "entry": entry, "argv": list(argv),
                         "stdout": str(stdout), "stderr": str(stderr or stdout),
                         "env": dict(os.environ if env is None else env),
                         "cwd": str(cwd or os.getcwd()), "session": new_session})
        deadline = time.monotonic() + self.answer_timeout_s
        while True:
            self.pump()
            with self._lock:
                ans = self._answers.pop(rid, None)
            if ans is not None:
                break
            if self.lost:
                raise RuntimeError(f"the fork server (pid {self.pid}) died")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the fork server (pid {self.pid}) did not answer within "
                                   f"{self.answer_timeout_s:.0f}s")
            self.wait_readable(0.05)
        if "error" in ans:
            raise RuntimeError(f"the fork server could not start {entry}: {ans['error']}")
        with self._lock:
            proc = ForkedProcess(self, int(ans["pid"]), [entry, *argv])
            self._children[proc.pid] = proc
            if proc.pid in self._exits:
                proc.returncode = self._exits.pop(proc.pid)
        return proc

    def signal(self, pid: int, sig: int) -> None:
        with self._lock:
            if not self.lost:
                self._write({"op": "signal", "pid": pid, "sig": int(sig)})

    def pump(self) -> None:
        """Read every line the server has written so far (never blocks)."""
        with self._lock:
            if self.lost:
                return
            while True:
                try:
                    data = os.read(self._resp, 65536)
                except BlockingIOError:
                    break
                if not data:
                    self._server_lost()
                    break
                self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if "exit" in msg:
                    pid, code = int(msg["exit"]), int(msg["code"])
                    if pid in self._children:
                        self._children[pid].returncode = code
                    else:
                        self._exits[pid] = code
                else:
                    self._answers[int(msg["id"])] = msg

    def wait_readable(self, timeout_s: float) -> None:
        if not self.lost:
            # poll(), not select(): a busy client can hold descriptors numbered above 1024.
            poller = select.poll()
            with contextlib.suppress(OSError, ValueError):
                poller.register(self._resp, select.POLLIN)
                poller.poll(max(0.0, timeout_s) * 1000)

    def close(self, grace_s: float = 10.0) -> None:
        """EOF to the server (it ends any child still running), then end it by PID."""
        with self._lock:
            if self.pid == 0:
                return
            with contextlib.suppress(OSError):
                os.close(self._req)
        deadline = time.monotonic() + grace_s
        while not self._reaped() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._reaped():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            while not self._reaped() and time.monotonic() < deadline:
                time.sleep(0.01)
        self.pump()  # the exits it reported, then EOF: anything unreported was SIGKILLed
        with self._lock:
            self._server_lost()
            with contextlib.suppress(OSError):
                os.close(self._resp)
            self.pid = 0

    def __enter__(self) -> ForkServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------
    def _write(self, msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._req, data):]
        except OSError:  # EPIPE: the server is gone; pump() notices the EOF
            pass

    def _reaped(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is not None
        try:
            return os.waitpid(self.pid, os.WNOHANG)[0] == self.pid
        except ChildProcessError:
            return True

    def _server_lost(self) -> None:
        # Every child not yet reported was SIGKILLed by PR_SET_PDEATHSIG when the server died.
        self.lost = True
        for proc in self._children.values():
            if proc.returncode is None:
                proc.returncode = -signal.SIGKILL


# -- the server ------------------------------------------------------------------------------------
def _serve_forever(req: int, resp: int, preload: Sequence[str]) -> None:
    """The server's loop; never returns (os._exit)."""
    os.closerange(3, min(req, resp))  # nothing else of the parent's: children inherit only ours
    os.closerange(min(req, resp) + 1, max(req, resp))
    os.closerange(max(req, resp) + 1, _max_fd())
    # Never collect what the server inherited: a finalizer could close a descriptor number
    # that was closed above and reused since (and frozen objects stay shared with children).
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's: it closes us
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd interrupts select()
    for name in preload:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    children: set[int] = set()
    own_fds = (req, resp, wake_r, wake_w)
    buf = b""

    def send(msg: dict[str, Any]) -> None:
        data = (json.dumps(msg) + "\n").encode()
        while data:
            data = data[os.write(resp, data):]

    def send_if_heard(msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # EPIPE: nobody listens any more
            send(msg)

    poller = select.poll()  # not select(): descriptors passed in may be numbered above 1024
    poller.register(req, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    try:
        while not stop["flag"]:
            ready = {fd for fd, _ in poller.poll(500)}
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            _reap(children, send)
            if req not in ready:
                continue
            data = os.read(req, 65536)
            if not data:
                break  # EOF: the client closed us or died
            *lines, buf = (buf + data).split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if msg["op"] == "spawn":
                    send(_fork(msg, children, own_fds))
                elif msg["op"] == "signal" and int(msg["pid"]) in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(msg["pid"]), int(msg["sig"]))
    except OSError:  # EPIPE: the client is gone
        pass
    _end_children(children, send_if_heard)
    os._exit(0)


def _reap(children: set[int], send: Callable[[dict[str, Any]], None]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in children:
            children.discard(pid)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _end_children(children: set[int], send: Callable[[dict[str, Any]], None],
                  grace_s: float = 5.0) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a stopped child ignores SIGTERM until continued
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while children and time.monotonic() < deadline:
        _reap(children, send)
        time.sleep(0.01)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while children and time.monotonic() < deadline:  # SIGKILL cannot be ignored: reap, report
        _reap(children, send)
        time.sleep(0.01)


def _fork(msg: dict[str, Any], children: set[int], own_fds: tuple[int, ...]) -> dict[str, Any]:
    try:
        func = _resolve(msg["entry"])
    except Exception as e:
        return {"id": msg["id"], "error": f"{type(e).__name__}: {e}"}
    if thread_count() != 1:  # a fork would copy locks held by threads that do not exist there
        return {"id": msg["id"], "error": f"the server has {thread_count()} threads"}
    server = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(msg, func, server, own_fds)
    children.add(pid)
    return {"id": msg["id"], "pid": pid}


def _resolve(entry: str) -> Callable[[list[str]], Any]:
    module, _, func = entry.partition(":")
    return getattr(importlib.import_module(module), func or "main")


def _child(msg: dict[str, Any], func: Callable[[list[str]], Any], server: int,
           own_fds: tuple[int, ...]) -> None:
    """Become the requested process; never returns."""
    global IN_CHILD
    code = 1
    try:
        if msg["session"]:
            os.setsid()
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:  # the server died before prctl took effect
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            handler = {signal.SIGINT: signal.default_int_handler,
                       signal.SIGPIPE: signal.SIG_IGN}.get(sig, signal.SIG_DFL)
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for fd in own_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(msg["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = (out if msg["stderr"] == msg["stdout"]
               else os.open(msg["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        os.closerange(3, _max_fd())
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=False)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                      errors="backslashreplace")
        sys.argv = [msg["entry"], *msg["argv"]]
        IN_CHILD = True
        code = _exit_code(func(list(msg["argv"])))
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _exit_code(value: object) -> int:
    """As the interpreter maps `sys.exit(value)` to an exit status."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _max_fd() -> int:
    try:
        return max(int(f) for f in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


if __name__ == "__main__":  # started by ForkServer.start: REQ_FD RESP_FD MODULE...
    # Run the importable module's copy, not __main__'s: children must see *its* IN_CHILD.
    from recover.app.train import forkserver

    forkserver._serve_forever(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
