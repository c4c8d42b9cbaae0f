"""`recover status` / `watch` / `report` and the launcher's HTTP endpoint, on one real run.

One short run (4 replicas, one slowed so that there is time to look, one killed mid-run) is
watched while it trains: `/status` and `/metrics` are scraped before and after the kill (the live
replica count drops, the fault counter rises), writes are refused, the endpoint is not reachable
on another local address, `recover status` prints the members and the fault during and after the
run, `recover watch` returns once the run ends, the end-of-run report is on disk and `recover
report` draws it again. The rest are in-process checks.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from harness.runs import BASE, Launch
from recover.app import cli, report, rundir, statusview
from recover.app.status import read_jsonl, read_status

KILLED, AT = 3, 4
TIMEOUT_S = 5.0


def _get(port: int, path: str, method: str = "GET", host: str = "127.0.0.1",
         body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _sample(text: str, name: str) -> float | None:
    """The value of the unlabelled sample `name` in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _scrape(port: int) -> dict[str, float | None]:
    status, body = _get(port, "/metrics")
    assert status == 200
    text = body.decode()
    return {k: _sample(text, f"recover_{k}") for k in
            ("live_replicas", "faults_total", "steps_committed_total", "generation",
             "store_requests_total")}


def _wait_for(cond, what: str, launch: Launch, limit_s: float = 120.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert launch.running(), f"the run ended before {what}:\n{launch.stderr()[-3000:]}"
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {limit_s}s")


def _status_text(capsys: pytest.CaptureFixture[str], run_dir: Path) -> str:
    capsys.readouterr()
    assert statusview.run_cli("status", [str(run_dir)]) == 0
    return capsys.readouterr().out


def test_watch_a_run_with_a_kill(corpus: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    # Replica 0 computes every step's share 2x slower (equal quotas): time to look.
    launch = Launch(out, *BASE, "--steps", "8", "--replicas", "4",
                    "--http-port", "0", "--fault", "slow:replica=0,factor=2", "--fault",
                    f"kill:replica={KILLED},step={AT}", data=corpus, report=True)
    try:
        port = int(_wait_for(lambda: (out / rundir.HTTP_PORT).exists() and
                             (out / rundir.HTTP_PORT).read_text().strip(), "http.port", launch))
        before = _wait_for(lambda: (m := _scrape(port))["live_replicas"] == 4 and m,
                           "4 live replicas", launch)
        assert before["faults_total"] == 0 and before["generation"] == 0
        status = json.loads(_get(port, "/status")[1])
        assert status["state"] == "running" and status["members"] == [0, 1, 2, 3]

        # The coordinator logs the evidence, then the generation without the lost replica.
        after = _wait_for(lambda: (m := _scrape(port))["live_replicas"] == 3 and m,
                          "3 live replicas", launch)
        assert after["faults_total"] == 1
        # The main store's requests (the coordinator's file, rewritten every 2 s) only grow.
        assert before["store_requests_total"] is not None
        assert after["store_requests_total"] >= before["store_requests_total"] > 0
        assert after["generation"] > before["generation"]
        assert after["steps_committed_total"] >= before["steps_committed_total"]
        text = _status_text(capsys, out)
        assert "running" in text and "members [0, 1, 2]" in text, text
        assert "lost" in text and "connection closed" in text, text

        # Read-only: every write is refused and changes nothing; other paths are not served.
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            assert _get(port, "/status", method, body=b"{}")[0] == 405
        assert _get(port, "/token")[0] == 404
        token = (out / rundir.RUN_TOKEN).read_text().strip()
        assert all(token.encode() not in _get(port, path)[1] for path in ("/status", "/metrics"))
        assert _get(port, "/status")[0] == 200
        # Bound to 127.0.0.1 only: the same port on another address of this machine (the rest
        # of 127/8 is this machine's loopback too) has nobody listening.
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port),
                                                              timeout=TIMEOUT_S):
            pass
        # `recover watch` returns by itself once the run's end is on disk.
        assert statusview.run_cli("watch", [str(out), "--interval", "0.2",
                                            "--timeout", "120"]) == 0
        assert read_status(out)["state"] == "finished"
        run = launch.finish()
    finally:
        if launch.running():
            launch.end()
    assert run.returncode == 0, run.stderr[-3000:]
    assert not (out / rundir.HTTP_PORT).exists()  # the endpoint is gone with the run
    # The report's plots log nothing on the terminal (matplotlib's category units did, twice).
    assert "matplotlib" not in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]

    text = _status_text(capsys, out)
    assert "finished" in text and "members at the last step [0, 1, 2]" in text, text
    assert "connection closed" in text
    model = read_status(out)
    [fault] = model["faults"]
    assert (fault["replica"], fault["kind"], fault["step"]) == (KILLED, "lost", AT)
    states = {r["replica"]: r["state"] for r in model["replica_states"]}
    assert states == {0: "left cleanly", 1: "left cleanly", 2: "left cleanly", 3: "lost"}
    # Quota and speed as the last step saw them: the lost replica had neither.
    last = read_jsonl(out / rundir.METRICS)[-1]
    assert [(r["quota"], r["mb_time_s"]) for r in model["replica_states"]] == [
        (last["quotas"].get(str(r)), last["speeds"].get(str(r))) for r in range(4)]
    assert [r["mb_time_s"] is not None and r["mb_time_s"] > 0
            for r in model["replica_states"]] == [True, True, True, False]
    assert model["committed"] == len(read_jsonl(out / rundir.METRICS))
    # Every member's requests reached the coordinator's count (its heartbeats carry them, the
    # lost replica's up to its last one): at least one a step for each of the three that went
    # through to the end, and their count at the end is what the file holds.
    assert model["store_requests"] >= 3 * model["committed"], model["store_requests"]
    assert f"store requests {model['store_requests']:,d}" in text, text

    # The end-of-run report, with every plot it names; then `recover report` on demand.
    md = (out / rundir.REPORT / rundir.REPORT_MD).read_text()
    assert "| state | finished |" in md
    pngs = sorted(p.name for p in (out / rundir.REPORT).glob("*.png"))
    assert pngs == ["loss.png", "recovery.png", "replicas.png", "step_time.png"]
    for name in pngs:
        assert f"({name})" in md
        assert (out / rundir.REPORT / name).read_bytes()[:4] == b"\x89PNG"
    assert f"| {AT} | {KILLED} | lost |" in md
    shutil.rmtree(out / rundir.REPORT)
    assert report.run_cli([str(out)]) == 0
    assert (out / rundir.REPORT / rundir.REPORT_MD).read_text() == md
    assert sorted(p.name for p in (out / rundir.REPORT).glob("*.png")) == pngs


def test_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("status", "watch", "report"):
        argv = [cmd, str(tmp_path)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a recover run directory" in err, err
    assert not (tmp_path / "report").exists()


def test_http_needs_its_extra(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    assert cli.main(["train", "--http-port", "0", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recover[http]" in err, err
    assert not (tmp_path / "run").exists()


def test_a_run_being_written(tmp_path: Path) -> None:
    """A line still being written is skipped, not an error: the model is read while the run
    appends to its files."""
    (tmp_path / "config.json").write_text(json.dumps({"run": {"steps": 4, "stop_at": 0},
                                                      "layout": {"replicas": 2}}))
    (tmp_path / rundir.RUN_START).write_text("1000.0\n")
    (tmp_path / rundir.COORDINATOR_LOG).write_text(
        json.dumps({"time": 1001.0, "event": "generation", "gen": 0, "members": [0, 1],
                    "reason": "initial membership"}) + '\n{"time": 1002.0, "ev')
    rec = {"step": 0, "loss": 5.0, "live_replicas": 2, "members": [0, 1], "generation": 0,
           "quotas": {"0": 4, "1": 4}, "time_s": 2.0, "step_time_s": 0.5, "tokens_per_s": 10.0}
    (tmp_path / rundir.METRICS).write_text(json.dumps(rec) + '\n{"step": 1, "lo')
    m = read_status(tmp_path, now=1010.0)
    assert (m["state"], m["committed"], m["step"], m["members"]) == ("running", 1, 0, [0, 1])
    assert m["elapsed_s"] == 10.0 and m["eta_s"] == 3 * 0.5  # 3 steps left at 0.5 s each
    assert [r["quota"] for r in m["replica_states"]] == [4, 4]
