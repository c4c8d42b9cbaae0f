"""The liveness session against a stranger on the wire (control/session.py).

Invariant checked, against a real coordinator's liveness listener with a run token: a hello
captured from one connection and replayed on another is refused; the old constant proof is
refused; on an accepted member's connection a line that is not sealed for its session (a
relay's injected `cut` or `ready`), a sealed line replayed, or one altered, is logged as
malformed and changes nothing, while the member's own sealed lines are heard.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from faults.conftest import Row
from recover.control import Coordinator, CoordinatorConfig, coordinator, session
from recover.control.admission import proof

pytestmark = pytest.mark.timeout(30)
TOKEN = "the liveness session's token"


class _Peer:
    """A raw liveness connection that speaks the session by hand."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""
        words = self.line().split()
        assert words[0] == "challenge", words
        self.challenge = words[1]

    def line(self) -> str:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                return "(closed)"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def hello(self, replica: int) -> tuple[str, session.Session]:
        words = ["hello", str(replica), "0", "1", str(os.getpid()), "-", "-"]
        words[session.PROOF_AT] = session.hello_proof(TOKEN, self.challenge, words)
        text = " ".join(words)
        self.sock.sendall((text + "\n").encode())
        return text, session.Session(TOKEN, self.challenge, words[session.PROOF_AT], "m")

    def close(self) -> None:
        self.sock.close()


def _events(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def _until(cond, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_replays_and_injected_lines_are_refused(tmp_path: Path, record: Row) -> None:
    record.scenario = ("liveness: a captured hello replayed on a new connection; the old constant "
                       "proof; a relay's bare `cut` and `ready`, a replayed and an altered sealed "
                       "line on a member's connection (tests/security, in-process coordinator)")
    record.expected = ("the hellos refused (wrong run token); each line logged `malformed`, no "
                       "cut, no eviction; the member's own sealed `cut` heard")
    log = tmp_path / "c.jsonl"
    coord = Coordinator(CoordinatorConfig(replicas=2, host="127.0.0.1", port=0, stale_s=5.0,
                                          token=TOKEN, log_path=str(log)))
    coord.start()
    stop = threading.Event()
    th = threading.Thread(target=coord.serve, args=(stop.is_set,), daemon=True)
    th.start()
    peers: list[_Peer] = []
    try:
        port = coord.liveness_port
        assert port is not None
        a, b = _Peer(port), _Peer(port)
        peers += [a, b]
        text_a, sess_a = a.hello(0)
        welcome = sess_a.open(a.line().encode())
        assert welcome is not None and welcome.startswith(b"welcome"), welcome
        _, sess_b = b.hello(1)
        assert (sess_b.open(b.line().encode()) or b"").startswith(b"welcome")
        _until(lambda: coord.generation == 0)
        # A's hello, captured and replayed on a new connection: its proof was for A's challenge.
        c = _Peer(port)
        peers.append(c)
        c.sock.sendall((text_a + "\n").encode())
        assert c.line().startswith("refused wrong run token")
        # The hello of before (a constant proof of the token, no challenge): refused too.
        d = _Peer(port)
        peers.append(d)
        d.sock.sendall(f"hello 0 0 1 {os.getpid()} {proof(TOKEN)} -\n".encode())
        assert d.line().startswith("refused wrong run token")
        # On B's connection, as a relay would: a bare `cut` and `ready`, B's own sealed line
        # replayed, and one altered. Then B's own sealed `cut`, which is heard.
        sealed_hb = sess_b.seal("hb 0.00 1\n").encode()
        b.sock.sendall(b"cut 0 0\nready 1\n" + sealed_hb + sealed_hb
                       + sealed_hb.replace(b"hb 0.00", b"cut 0 0"))
        _until(lambda: sum(e.get("error") == "not sealed for this connection's session"
                           for e in _events(log)) >= 4)
        assert not [e for e in _events(log) if e["event"] == "cut"]
        assert coord.members == [0, 1]
        refused = sum(e["event"] == "refused" for e in _events(log))
        dropped = sum(e.get("error") == "not sealed for this connection's session"
                      for e in _events(log))
        record.measured = f"{refused} hellos refused, {dropped} lines ignored, members [0, 1]"
        b.sock.sendall(sess_b.seal("cut 0 0\n").encode())
        _until(lambda: any(e["event"] == "cut" and e["replica"] == 1 for e in _events(log)))
    finally:
        for p in peers:
            p.close()
        stop.set()
        th.join(10)
        coord.close()


def test_a_session_takes_only_sealed_newer_lines() -> None:
    member = session.Session(TOKEN, "0" * 32, "p" * 64, "m")
    coord = session.Session(TOKEN, "0" * 32, "p" * 64, "c")
    other = session.Session(TOKEN, "1" * 32, "p" * 64, "c")  # another connection's
    first, second = coord.seal("ping 3\n"), coord.seal("gen 4 3 1 -\n")
    assert member.open(second.strip().encode()) == b"gen 4 3 1 -"
    assert member.open(first.strip().encode()) is None  # older than one taken: a reorder
    assert member.open(second.strip().encode()) is None  # a replay
    assert member.open(other.seal("gen 9\n").strip().encode()) is None
    assert member.open(b"gen 9") is None and member.open(b"gen 9 ~5.zz") is None
    assert coord.open(member.seal("cut 0 1\n").strip().encode()) == b"cut 0 1"
    assert member.open(coord.seal("a\nb\n").split("\n")[1].encode()) == b"b"  # one a line


def test_junk_and_a_full_disk_never_stop_the_event_log(caplog: pytest.LogCaptureFixture,
                                                       tmp_path: Path) -> None:
    """Junk from one peer is kept NOISY_BURST times a window, the rest counted; an event log on
    a full disk (/dev/full: every write fails with ENOSPC) is reported once, never raised."""
    path = tmp_path / "events.jsonl"
    events = coordinator.EventLog(str(path))
    for k in range(500):
        events({"event": "malformed", "line": f"junk {k}", "peer": "10.0.0.9"})
    events({"event": "malformed", "line": "another peer's", "peer": "10.0.0.8"})
    kept = _events(path)
    assert len(kept) == coordinator.NOISY_BURST + 1, len(kept)
    full = coordinator.EventLog("/dev/full")
    for k in range(50):
        full({"event": "generation", "gen": k})
    assert sum("cannot append to the event log" in r.message for r in caplog.records) == 1
