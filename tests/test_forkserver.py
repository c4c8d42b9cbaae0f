"""recover.app.train.forkserver: real, separate, clean children; exit statuses; signals; cleanup.

Most tests use the session's server (tests/_procs.py, which every process test uses too); entry
points live in tests/_fs_entries.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _procs import session_server
from recover.app.train import forkserver
from recover.app.train.forkserver import ForkServer

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not forkserver.enabled(), reason="no fork server here")]
TESTS = str(Path(__file__).parent)


@pytest.fixture
def server() -> ForkServer:
    srv = session_server()
    assert srv is not None
    return srv


def report(path: Path, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.01)
    return json.loads(path.read_text())


def test_child_starts_clean(server: ForkServer, tmp_path: Path) -> None:
    out, log = tmp_path / "probe.json", tmp_path / "probe.log"
    env = dict(os.environ, FS_TEST="from-the-request")
    p = server.spawn("_fs_entries:probe", [str(out), "7"], log, env=env, cwd=tmp_path)
    assert p.wait(60) == 7 and p.returncode == 7 and p.poll() == 7
    r = report(out)
    assert r["pid"] == p.pid != os.getpid() and r["ppid"] == server.pid
    assert r["threads"] == 1  # nothing but the main thread was copied
    assert r["fds"] == [0, 1, 2, 3], r["fds"]  # 3: the listdir of /proc/self/fd itself
    assert r["stdin"] == os.devnull
    assert r["handlers"] == {"SIGTERM": repr(signal.SIG_DFL), "SIGCHLD": repr(signal.SIG_DFL),
                             "SIGUSR1": repr(signal.SIG_DFL), "SIGPIPE": repr(signal.SIG_IGN),
                             "SIGINT": repr(signal.default_int_handler)}
    assert r["mask"] == []
    assert r["env"] == "from-the-request" and r["cwd"] == str(tmp_path)
    assert r["argv"] == ["_fs_entries:probe", str(out), "7"]
    assert r["in_child"] and not r["sid"]
    # stdout is block-buffered (flushed at exit), stderr line-buffered: as in a fresh Python.
    assert log.read_text().splitlines() == ["to stderr", "to stdout"]
    # The server itself stays single-threaded between forks.
    assert len(os.listdir(f"/proc/{server.pid}/task")) == 1


def test_exit_statuses_and_separate_stderr(server: ForkServer, tmp_path: Path) -> None:
    out, err = tmp_path / "o.log", tmp_path / "e.log"
    assert server.spawn("_fs_entries:fail", ["x", "boom"], out, err).wait(60) == 1
    assert "ValueError: failing on purpose: boom" in err.read_text()
    assert server.spawn("_fs_entries:leave", ["x", "goodbye"], out, err).wait(60) == 1
    assert err.read_text().rstrip().endswith("goodbye")
    with pytest.raises(RuntimeError, match="No module named"):
        server.spawn("_fs_entries_missing:main", [], out)
    probe = server.spawn("_fs_entries:probe", [str(tmp_path / "p.json"), "0"], out, err,
                         new_session=True)
    assert probe.wait(60) == 0 and report(tmp_path / "p.json")["sid"]


def test_sigkill_is_a_real_crash(server: ForkServer, tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as lsn:
        lsn.settimeout(60)
        p = server.spawn("_fs_entries:sleeper", [str(tmp_path / "s.json"),
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
    t = server.spawn("_fs_entries:sleeper", [str(tmp_path / "t.json"), "1"], tmp_path / "t.log")
    t.terminate()  # before it even connected (port 1 refuses; SIGTERM may land first)
    assert t.wait(30) in (-signal.SIGTERM, 1)


def test_nested_server_forks_itself(server: ForkServer, tmp_path: Path) -> None:
    """A fork-server child (a `recover train` launcher, in the tests) starts its own server by
    forking itself: no second torch import."""
    out = tmp_path / "n.json"
    p = server.spawn("_fs_entries:nested", [str(out)], tmp_path / "n.log")
    assert p.wait(60) == 0, (tmp_path / "n.log").read_text()
    r = report(out)
    assert r["forked"] and r["inner_code"] == 0
    inner = report(Path(f"{out}.inner"))
    assert inner["ppid"] == r["server_pid"] and inner["threads"] == 1
    assert inner["fds"] == [0, 1, 2, 3]


def test_close_ends_children_and_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    srv = ForkServer(("_fs_entries",)).start()
    with socket.create_server(("127.0.0.1", 0)) as lsn:
        lsn.settimeout(60)
        kids = [srv.spawn("_fs_entries:sleeper", [str(tmp_path / f"{i}.json"),
                                                  str(lsn.getsockname()[1])], tmp_path / "l")
                for i in range(2)]
        for i in range(2):
            report(tmp_path / f"{i}.json")
        srv_pid = srv.pid
        srv.close()  # EOF: the server ends both (SIGTERM) and exits
        assert [k.returncode for k in kids] == [-signal.SIGTERM] * 2
        assert not Path(f"/proc/{srv_pid}").exists()
        # A server that dies abruptly takes its children with it (PR_SET_PDEATHSIG).
        srv = ForkServer(("_fs_entries",)).start()
        kid = srv.spawn("_fs_entries:sleeper", [str(tmp_path / "k.json"),
                                                str(lsn.getsockname()[1])], tmp_path / "l")
        report(tmp_path / "k.json")
        os.kill(srv.pid, signal.SIGKILL)
        assert kid.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while Path(f"/proc/{kid.pid}").exists() and "Z" not in _state(kid.pid):
            assert time.monotonic() < deadline, "the child outlived its server"
            time.sleep(0.01)
        srv.close()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_disabled_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECOVER_FORKSERVER", "0")
    assert not forkserver.enabled()
    monkeypatch.setenv("RECOVER_FORKSERVER", "1")
    assert forkserver.enabled() == sys.platform.startswith("linux")


def _live_children() -> set[int]:
    """Live (not zombie) child processes of this test process, from /proc."""
    me, out = os.getpid(), set()
    for d in Path("/proc").glob("[0-9]*"):
        try:
            state, ppid = d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == me and state != "Z":
            out.add(int(d.name))
    return out


def test_launch_ends_its_server_on_error(corpus: Path, tmp_path: Path) -> None:
    """The launcher's fork server is ended even when the launch fails (here: the coordinator
    cannot bind its port), and so is every process it had started."""
    from recover.app.config import preset
    from recover.app.train.launch import launch
    from recover.errors import RecoverError

    cfg = preset("debug")
    cfg.layout.replicas, cfg.run.steps = 2, 2
    cfg.data.path, cfg.run.out = str(corpus), str(tmp_path / "run")
    before = _live_children()
    with socket.create_server(("0.0.0.0", 0)) as taken, \
            pytest.raises(RecoverError, match="coordinator did not start"):
        launch(cfg, quiet=True, port=taken.getsockname()[1])
    assert "cannot start on port" in (tmp_path / "run" / "logs" / "coordinator.log").read_text()
    assert _live_children() <= before
