"""`recover.procs`: ending processes by PID (stopped and stubborn ones too) in bounded time, and
the `Spawner`'s forked entry points: real, separate, clean children; exit statuses; signals only
to live processes; none outliving what started it.

Each test starts a few short Python processes and checks how (and how fast) they end; every
process is ended in a `finally` (or by its spawner's `close`) by PID, whatever the assertions said.
Forked entry points live in tests/_fs_entries.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recover.app import rundir
from recover.procs import (
    Spawner,
    alive,
    descendants,
    forkserver_available,
    kill_pids,
    start,
    stop,
    stop_all,
    stop_pids,
)

pytestmark = pytest.mark.timeout(120)

SLEEP = "import time; print('up', flush=True); time.sleep(60)"
# Handles SIGTERM (as a trainer that cleans up would): exit code 7 proves the handler ran.
HANDLER = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); "
           "print('up', flush=True); time.sleep(60)")
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(60)")


def started(cmd: str, log: Path, ready: bytes = b"up") -> subprocess.Popen:
    """Start `python -c cmd` and wait (bounded) until it has printed `ready`."""
    proc = start([sys.executable, "-c", cmd], log)
    deadline = time.monotonic() + 30
    while ready not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    return proc


def test_stopped_process_runs_its_sigterm_handler(tmp_path: Path) -> None:
    proc = started(HANDLER, tmp_path / "a.log")
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # a hang fault: a handler cannot run until SIGCONT
        t0 = time.monotonic()
        assert stop(proc, grace_s=20.0) == 7
        assert time.monotonic() - t0 < 10.0  # did not sit out the grace period
    finally:
        stop(proc, grace_s=0.0)


def test_sigterm_ignored_gets_sigkill_after_grace(tmp_path: Path) -> None:
    procs = [started(STUBBORN, tmp_path / "b.log"), started(SLEEP, tmp_path / "c.log")]
    try:
        t0 = time.monotonic()
        stop_all(procs, grace_s=0.5)
        assert time.monotonic() - t0 >= 0.5
        assert [p.returncode for p in procs] == [-signal.SIGKILL, -signal.SIGTERM]
    finally:
        stop_all(procs, grace_s=0.0)


def test_descendants_and_foreign_pids(tmp_path: Path) -> None:
    # A parent that starts a grandchild and reports its PID: the grandchild is not our child.
    parent_cmd = ("import subprocess, sys, time; "
                  f"c = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); "
                  "print('parent-up', c.pid, flush=True); time.sleep(60)")
    # Its own line: the grandchild writes its "up" to the same log, maybe first.
    parent = started(parent_cmd, tmp_path / "p.log", b"parent-up")
    deadline = time.monotonic() + 30  # the whole line: its PID may land after "parent-up"
    while not (found := re.search(r"^parent-up (\d+)$", (tmp_path / "p.log").read_text(), re.M)):
        assert time.monotonic() < deadline, (tmp_path / "p.log").read_text()
        time.sleep(0.01)
    grandchild = int(found.group(1))
    try:
        assert descendants(parent.pid) == [grandchild]
        assert alive(grandchild)
        t0 = time.monotonic()
        stop_pids([grandchild], grace_s=0.5)  # ignores SIGTERM: SIGKILL, reaped by its parent
        assert time.monotonic() - t0 < 10.0
        assert not alive(grandchild)  # gone, or a zombie its sleeping parent has not reaped
        assert stop(parent, grace_s=5.0) == -signal.SIGTERM
        assert descendants(parent.pid) == []
    finally:
        kill_pids([grandchild])
        stop(parent, grace_s=0.0)



# -- Spawner: entry points forked by the standard library's fork server ----------------------------
forks = pytest.mark.skipif(not forkserver_available(), reason="no fork server here")


@pytest.fixture
def spawner() -> Iterator[Spawner]:
    with Spawner(("_fs_entries",)) as s:
        yield s


def report(path: Path, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.01)
    return json.loads(path.read_text())


@forks
def test_forked_child_starts_clean(spawner: Spawner, tmp_path: Path) -> None:
    out, log = tmp_path / "probe.json", tmp_path / "probe.log"
    env = dict(os.environ, FS_TEST="from-the-request")
    p = spawner.start("_fs_entries:probe", [str(out), "7"], log, env=env, cwd=tmp_path)
    assert p.wait(60) == 7 and p.returncode == 7 and p.poll() == 7
    r = report(out)
    assert r["pid"] == p.pid != os.getpid()
    assert r["threads"] == 1 and r["server_threads"] == 1  # a fork copies only its thread
    # Nothing inherited but stdio and multiprocessing's resource tracker; the last: the listdir.
    assert len(set(r["fds"]) - {0, 1, 2, r["tracker_fd"]}) == 1, r["fds"]
    assert r["stdin"] == os.devnull
    assert r["handlers"] == {"SIGTERM": repr(signal.SIG_DFL), "SIGCHLD": repr(signal.SIG_DFL),
                             "SIGUSR1": repr(signal.SIG_DFL), "SIGPIPE": repr(signal.SIG_IGN),
                             "SIGINT": repr(signal.default_int_handler)}
    assert r["mask"] == []
    assert r["env"] == "from-the-request" and r["cwd"] == str(tmp_path)
    assert r["argv"] == ["_fs_entries:probe", str(out), "7"]
    assert not r["sid"]
    # stdout is block-buffered (flushed at exit), stderr line-buffered: as in a fresh Python.
    assert log.read_text().splitlines() == ["to stderr", "to stdout"]


@forks
def test_forked_exit_statuses_and_separate_stderr(spawner: Spawner, tmp_path: Path) -> None:
    out, err = tmp_path / "o.log", tmp_path / "e.log"
    assert spawner.start("_fs_entries:fail", ["x", "boom"], out, err).wait(60) == 1
    assert "ValueError: failing on purpose: boom" in err.read_text()
    assert spawner.start("_fs_entries:leave", ["x", "goodbye"], out, err).wait(60) == 1
    assert err.read_text().rstrip().endswith("goodbye")
    with pytest.raises(RuntimeError, match="No module named"):
        spawner.start("_fs_entries_missing:main", [], out)
    probe = spawner.start("_fs_entries:probe", [str(tmp_path / "p.json"), "0"], out, err,
                          new_session=True)
    assert probe.wait(60) == 0 and report(tmp_path / "p.json")["sid"]


@forks
def test_forked_sigkill_is_a_real_crash(spawner: Spawner, tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as lsn:
        lsn.settimeout(60)
        p = spawner.start("_fs_entries:sleeper", [str(tmp_path / "s.json"),
                                                  str(lsn.getsockname()[1])], tmp_path / "s.log")
        conn, _ = lsn.accept()
        with conn:
            conn.settimeout(60)
            assert conn.recv(6) == b"hello\n"
            report(tmp_path / "s.json")
            assert p.poll() is None
            with pytest.raises(subprocess.TimeoutExpired):
                p.wait(0.2)
            p.kill()
            assert p.wait(30) == -signal.SIGKILL
            assert conn.recv(1) == b""  # the kernel closed the dead child's socket
    p.send_signal(signal.SIGTERM)  # after the exit: a no-op, never a recycled PID
    assert p.returncode == -signal.SIGKILL
    t = spawner.start("_fs_entries:sleeper", [str(tmp_path / "t.json"), "1"], tmp_path / "t.log")
    t.terminate()  # before it even connected (port 1 refuses; SIGTERM may land first)
    assert t.wait(30) in (-signal.SIGTERM, 1)


@forks
def test_close_ends_children_and_a_survivor_outlives_a_sibling(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as lsn:
        lsn.settimeout(60)
        port = str(lsn.getsockname()[1])
        spawner = Spawner(("_fs_entries",))
        kids = [spawner.start("_fs_entries:sleeper", [str(tmp_path / f"{i}.json"), port],
                              tmp_path / "l") for i in range(2)]
        for i in range(2):
            report(tmp_path / f"{i}.json")
        kids[0].kill()
        assert kids[0].wait(30) == -signal.SIGKILL
        with pytest.raises(subprocess.TimeoutExpired):  # a sibling's death leaves it running
            kids[1].wait(0.5)
        spawner.close()  # by PID: SIGCONT, SIGTERM
        assert [k.returncode for k in kids] == [-signal.SIGKILL, -signal.SIGTERM]
        assert spawner.children == []


@forks
def test_children_die_with_their_spawner(spawner: Spawner, tmp_path: Path) -> None:
    """A spawning process that dies abruptly (SIGKILL: no cleanup of its own) takes what it
    forked with it: its fork server exits, and its children get SIGKILL (PR_SET_PDEATHSIG)."""
    with socket.create_server(("127.0.0.1", 0)) as lsn:
        out = tmp_path / "parent.json"
        parent = spawner.start("_fs_entries:parent", [str(out), str(lsn.getsockname()[1])],
                               tmp_path / "parent.log")
        kid = report(out)["kid"]
        assert alive(kid) and kid in descendants(parent.pid)
        parent.kill()
        assert parent.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while alive(kid):
            assert time.monotonic() < deadline, "a child outlived its spawner"
            time.sleep(0.01)


def test_plain_spawner_runs_the_module(tmp_path: Path) -> None:
    """Without a fork server (RECOVER_FORKSERVER=0, or not Linux): `python -m module argv`."""
    log = tmp_path / "plain.log"
    with Spawner(fork=False) as plain:
        p = plain.start("recover", ["--version"], log)
        assert p.wait(60) == 0 and p.pid != os.getpid()
    assert log.read_text().strip().startswith("recover ")


def test_forkserver_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECOVER_FORKSERVER", "0")
    assert not forkserver_available() and not Spawner().fork
    monkeypatch.setenv("RECOVER_FORKSERVER", "1")
    assert forkserver_available() == sys.platform.startswith("linux")


@forks
def test_launch_ends_its_processes_on_error(corpus: Path, tmp_path: Path) -> None:
    """The launcher ends every process it had started even when the launch fails (here: the
    coordinator cannot bind its port)."""
    from recover.app.config import preset
    from recover.app.train.launch import launch
    from recover.errors import RecoverError

    cfg = preset("debug")
    cfg.layout.replicas, cfg.run.steps = 2, 2
    cfg.data.path, cfg.run.out = str(corpus), str(tmp_path / "run")
    Spawner().warm()  # this process's fork server (and resource tracker) run from here on
    before = set(descendants(os.getpid()))
    with socket.create_server(("0.0.0.0", 0)) as taken, \
            pytest.raises(RecoverError, match="coordinator did not start"):
        launch(cfg, quiet=True, port=taken.getsockname()[1])
    coordinator_out = tmp_path / "run" / rundir.LOGS / rundir.COORDINATOR_OUT
    assert "cannot start on port" in coordinator_out.read_text()
    assert {p for p in descendants(os.getpid()) if alive(p)} <= before
