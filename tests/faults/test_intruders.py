"""Strangers at the coordinator: a worker of another run, and fuzzed liveness-port input.

Invariant checked: what does not belong to the run is refused (with a clear reason to a worker,
a logged `refused`/`malformed` event for raw input) and the run is unaffected: all four replicas
stay members and `conftest.check_run` holds. The run is slowed (every replica 8x, which changes
no number) so that the strangers arrive while it trains.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from faults.conftest import Row, check_run, fault_args, measure
from harness.processes import session
from harness.runs import (
    LAYOUT_ARGS,
    LAYOUT_FLAGS,
    LAYOUT_STEPS,
    Launch,
    Run,
    max_rel,
    two_free_ports,
)
from recover.app import rundir
from recover.control import session as liveness
from recover.control.admission import proof
from recover.procs import Process

pytestmark = pytest.mark.timeout(240)
# From step 1: step 0 carries the start-up's one-off costs, and 8 x those on a loaded machine
# made one replica 12 s late to the first reduce, evicted before any stranger came (a CI run).
# Slow enough that the run outlives two foreign workers and the 34 fuzzed connections (at 8x a
# fast machine ended the run while the fuzz was still connecting).
SLOW = [f"slow:replica={r},factor=16,step=1" for r in range(4)]


def _started(out: Path, launch: Launch, steps: int = 2) -> dict:
    """The coordinator's start event, once `steps` steps committed."""
    deadline = time.monotonic() + 120
    while not (out / rundir.METRICS).exists() or \
            len((out / rundir.METRICS).read_text().splitlines()) < steps:
        assert time.monotonic() < deadline and launch.proc.poll() is None, launch.stderr()[-2000:]
        time.sleep(0.05)
    return json.loads((out / rundir.COORDINATOR_LOG).read_text().splitlines()[0])


def _foreign_worker(run_dir: Path, port: int, log: Path, env: dict[str, str]) -> tuple[int, str]:
    """A real worker process aimed at this run's coordinator; (exit code, its stderr)."""
    argv = ["--run-dir", str(run_dir), "--replica", "1", "--coordinator", f"127.0.0.1:{port}"]
    # Forked with torch imported: it arrives while the run trains.
    p: Process = session().start("recover.app.train.worker:main", argv, log, env=env,
                                 new_session=True)
    try:
        p.wait(90)
    except subprocess.TimeoutExpired:
        p.kill()  # by its PID
        p.wait(10)
        raise AssertionError("a foreign worker was not refused in time:\n"
                             f"{log.read_text()}") from None
    return p.returncode, log.read_text(errors="replace")


def _fuzz(port: int, token: str, seed: int = 0) -> None:
    """Raw lines to the liveness port, each on its own connection, ends closed by us."""
    rng = random.Random(seed)

    def proved(words: list[str]) -> Callable[[str], bytes]:
        """A hello of this run, its proof over the connection's challenge (session.py)."""
        def line(challenge: str) -> bytes:
            words[liveness.PROOF_AT] = liveness.hello_proof(token, challenge, words)
            return (" ".join(words) + "\n").encode()
        return line

    lines: list[bytes | Callable[[str], bytes]] = [
        b"hb\n", b"fail 0 1,2\n", b"lost x\n", b"bye\n", b"ready 1\n", b"hello\n",
        b"hello x y z w\n", b"hello 99 0 1 1\n", b"hello 0 0 1 1 wrongtoken -\n",
        proved(["hello", "1", "0", "1", "1", "-", "-"]),  # right run, replica 1 is connected
        proved(["hello", "0", "0", "1", "1", "-", "notthefingerprint"]),
        b"\xff\xfe\x00garbage\n", b"A" * 10000, b"\n\n\n"]
    lines += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))) + b"\n"
              for _ in range(20)]
    for line in lines:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.settimeout(2)
            try:
                challenge = s.recv(256).decode(errors="replace").split()  # challenge <nonce>
                if callable(line):
                    line = line(challenge[1])
                s.sendall(line)
                s.recv(256)  # a refusal, or the close; either way the coordinator answered
            except OSError:
                pass


def test_foreign_worker_and_fuzzed_input(ref4: Run, corpus: Path, tmp_path: Path,
                                         record: Row) -> None:
    record.scenario = "worker of another run / wrong token; fuzzed liveness-port input"
    record.expected = "refused with a clear reason; malformed lines logged; run unaffected"
    out = tmp_path / "run"
    launch = Launch(out, *fault_args(*SLOW), data=corpus)
    try:
        start = _started(out, launch)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        # Another run's directory (its own token and config), then this run's with a wrong token.
        rc_other, err_other = _foreign_worker(ref4.out, start["port"], tmp_path / "w1.log", env)
        rc_token, err_token = _foreign_worker(out, start["port"], tmp_path / "w2.log",
                                              {**env, "RECOVER_RUN_TOKEN": "not-this-run"})
        _fuzz(start["liveness_port"], (out / rundir.RUN_TOKEN).read_text().strip())
        assert launch.proc.poll() is None, "the run ended before the strangers were done"
    finally:
        run = launch.finish(180)
    assert run.returncode == 0, run.stderr[-3000:]
    record.measured = measure(run)
    assert rc_other != 0 and "refused" in err_other and "token" in err_other, err_other[-2000:]
    assert rc_token != 0 and "refused" in err_token and "token" in err_token, err_token[-2000:]
    recs = check_run(run, ref4, [0, 1, 2, 3])
    assert all(r["live_replicas"] == 4 for r in recs)
    events = [json.loads(x) for x in (out / rundir.COORDINATOR_LOG).read_text().splitlines()]
    kinds = [e["event"] for e in events]
    # The fuzz's four hellos; the foreign workers are refused before their hello (the
    # coordinator's `coord/run` proves another token: control/member.py `_check_run`).
    assert kinds.count("refused") >= 4 and kinds.count("malformed") >= 10, kinds
    assert any("already connected" in e.get("why", "") for e in events)
    assert any("config differs" in e.get("why", "") for e in events)


def _worker(out: Path, port_file: Path, replica: int, rank: int, log: Path,
            token: str) -> Process:
    """One rank of an hsdp replica, started by hand as a cluster's launcher would."""
    argv = ["--run-dir", str(out), "--replica", str(replica), "--rank", str(rank),
            "--coordinator", f"127.0.0.1:{port_file.read_text().strip()}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RECOVER_RUN_TOKEN": token}
    return session().start("recover.app.train.worker:main", argv, log, env=env, new_session=True)


def test_a_wrong_run_worker_never_touches_an_hsdp_replica(single_replica: Run, corpus: Path,
                                                         tmp_path: Path) -> None:
    """A run keyed by RECOVER_RUN_TOKEN (spaces and all: only proofs of it travel) with hsdp
    replicas launched by hand. A worker with another token, aimed at replica 1's rank 0 before
    the real ranks start, stops with one line and never reaches the replica's own rendezvous
    (its prefix is keyed by the token); the run trains to its end on the reference trajectory.
    """
    token = "this run's token, with spaces"
    out = tmp_path / "run"
    launch = Launch(out, *LAYOUT_ARGS, *LAYOUT_FLAGS["hsdp"], "--replicas", "2",
                    "--external-workers", "--port", str(two_free_ports()), data=corpus,
                    env={**os.environ, "RECOVER_RUN_TOKEN": token})
    port_file = out / rundir.COORDINATOR_PORT
    workers: list[Process] = []
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert time.monotonic() < deadline and launch.running(), launch.stderr()[-2000:]
            time.sleep(0.05)
        assert not (out / rundir.RUN_TOKEN).exists()  # the env is the token: no file is written
        intruder = _worker(out, port_file, 1, 0, tmp_path / "intruder.log", "another run's")
        assert intruder.wait(60) == 2
        said = [x for x in (tmp_path / "intruder.log").read_text().splitlines() if x.strip()]
        assert len(said) == 1 and "wrong run token" in said[0], said
        workers = [_worker(out, port_file, r, k, tmp_path / f"w{r}.{k}.log", token)
                   for r in range(2) for k in range(2)]
        run = launch.finish(180)
    finally:
        if launch.running():
            launch.end()
        for w in workers:
            if w.poll() is None:
                w.kill()  # by its PID
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(LAYOUT_STEPS))
    assert all(r["live_replicas"] == 2 for r in recs)
    assert max_rel(run.losses(), single_replica.losses()) < 1e-5
    assert all(w.wait(30) == 0 for w in workers)


def test_a_duplicate_rank_or_a_wrong_run_stops_before_the_rendezvous() -> None:
    """The checks `init_replica_group` makes before it rendezvous, on a real store: the
    coordinator's proof must match the worker's token, and each (replica, incarnation, rank) is
    claimed once; the group's prefix is the token's, and says nothing of it."""
    from recover.control import CoordinatorLost, connect_store, keys
    from recover.layouts import mesh

    server = keys.serve_store("127.0.0.1", 0)
    store = connect_store("127.0.0.1", server.port, 10)
    store.set(keys.RUN_PROOF, proof("tok", keys.RUN_PURPOSE))
    mesh.check_run(store, "tok", 5)
    with pytest.raises(CoordinatorLost, match="wrong run token"):
        mesh.check_run(store, "another", 5)
    with pytest.raises(CoordinatorLost, match="wrong run token"):
        mesh.check_run(store, None, 5)
    prefix = mesh.group_prefix(1, "0", "tok")
    assert "tok" not in prefix and prefix != mesh.group_prefix(1, "0", "another")
    mesh.claim_rank(store, prefix, 0)
    mesh.claim_rank(store, prefix, 1)
    with pytest.raises(CoordinatorLost, match=f"rank 0 of this replica .* already running .*"
                                              f"pid {os.getpid()}"):
        mesh.claim_rank(connect_store("127.0.0.1", server.port, 10), prefix, 0)
