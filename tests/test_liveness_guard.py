"""The liveness listener against connections that never say hello (control/liveness.py).

A stranger is dropped HELLO_S after its accept, and strangers from one address hold at most a
quarter of the coordinator's descriptors: 200 idle connections against a coordinator limited to 96
open files never keep a well-formed hello from its welcome.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recover import procs
from recover.control import Coordinator, CoordinatorConfig, coordinator, session

pytestmark = pytest.mark.timeout(60)
TOKEN = "a token, with spaces\tand a tab"  # any characters: only its proof travels


def _line(s: socket.socket, buf: bytes = b"") -> tuple[str, bytes]:
    """The next line from `s` ("(closed)" if it closed first), and what came after it."""
    while b"\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            return "(closed)", b""
        buf += chunk
    line, rest = buf.split(b"\n", 1)
    return line.decode(), rest


def _hello(s: socket.socket, token: str, replica: int) -> bytes:
    """Answer the coordinator's challenge with a well-formed hello as (replica, 0/1)
    (control/session.py); what came after the challenge."""
    challenge, rest = _line(s)
    words = ["hello", str(replica), "0", "1", str(os.getpid()), "-", "-"]
    words[session.PROOF_AT] = session.hello_proof(token, challenge.split()[1], words)
    s.sendall((" ".join(words) + "\n").encode())
    return rest


def _welcomed(port: int, token: str, replica: int = 0, within_s: float = 10.0) -> str:
    """Say a well-formed hello as (replica, 0/1) and return the coordinator's answer (its
    session's seal, if any, left out)."""
    with socket.create_connection(("127.0.0.1", port), timeout=within_s) as s:
        line, _ = _line(s, _hello(s, token, replica))
        return line.rpartition(" ~")[0] if " ~" in line else line


@contextlib.contextmanager
def _idle(port: int, count: int) -> Iterator[list[socket.socket]]:
    socks = []
    try:
        for _ in range(count):
            with contextlib.suppress(OSError):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield socks
    finally:
        for s in socks:
            s.close()


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the coordinator closed `s` (what it sent before, if anything, is read past)."""
    s.settimeout(0.0)
    try:
        while s.recv(4096):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_connections_never_starve_a_hello(tmp_path: Path) -> None:
    """A coordinator process with 96 descriptors, 200 idle connections: a hello is welcomed."""
    port_file = tmp_path / "port"
    token_file = tmp_path / "run.token"
    token_file.write_text(TOKEN + "\n")
    argv = [sys.executable, "-m", "recover.control.coordinator", "--replicas", "2",
            "--host", "127.0.0.1", "--port", "0", "--liveness-port", "0",
            "--port-file", str(port_file), "--token-file", str(token_file),
            "--log", str(tmp_path / "coordinator.jsonl")]
    cmd = ["sh", "-c", "ulimit -n 96 && exec " + shlex.join(argv)]
    proc = procs.start(cmd, tmp_path / "coordinator.log")
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "coordinator.log").read_text()
            time.sleep(0.05)
        lport = _liveness_port(tmp_path / "coordinator.jsonl")
        with _idle(lport, 200) as socks:
            time.sleep(0.5)  # let it accept (and drop) what it can
            assert _welcomed(lport, TOKEN).startswith("welcome 0 ")
            dropped = sum(_closed_by_peer(s) for s in socks)
        assert dropped >= 200 - 96, dropped  # most idle ones were let go, not held
        assert proc.poll() is None, (tmp_path / "coordinator.log").read_text()
        events = (tmp_path / "coordinator.jsonl").read_text()
        assert '"stranger-dropped"' in events
    finally:
        procs.stop(proc)


def _liveness_port(log: Path, within_s: float = 10.0) -> int:
    import json

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text().splitlines():
                rec = json.loads(line)
                if rec["event"] == "start":
                    return int(rec["liveness_port"])
        time.sleep(0.05)
    raise AssertionError("the coordinator logged no start event")


def test_a_connection_without_a_hello_is_dropped(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Silent past HELLO_S: dropped; a member that said hello stays, whatever its token holds."""
    monkeypatch.setattr(coordinator, "HELLO_S", 0.5)
    coord = Coordinator(CoordinatorConfig(replicas=2, host="127.0.0.1", port=0, stale_s=5.0,
                                          token=TOKEN, log_path=str(tmp_path / "c.jsonl")))
    coord.start()
    stop = threading.Event()
    th = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    th.start()
    try:
        assert coord.liveness_port is not None
        silent = socket.create_connection(("127.0.0.1", coord.liveness_port), timeout=5)
        member = socket.create_connection(("127.0.0.1", coord.liveness_port), timeout=5)
        member.settimeout(5)
        _hello(member, TOKEN, 1)
        time.sleep(1.5)
        assert _closed_by_peer(silent)
        assert not _closed_by_peer(member)
        assert _welcomed(coord.liveness_port, "not the token").startswith("refused wrong run")
        silent.close()
        member.close()
    finally:
        stop.set()
        th.join(10)
