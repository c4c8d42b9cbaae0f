"""The scheduler path: the TorchX component run by TorchX's `local_cwd` scheduler, and the Slurm
and Kubernetes recipes rendered from the parameters the component takes.

The run: `torchx run -s local_cwd recover.torchx:train` with 3 replicas (debug preset, the
suite's BASE settings), one replica's worker SIGKILLed by its PID after the first step; its
task's loop starts its torchrun again, it rejoins (metrics.jsonl's live_replicas back to 3), the
job ends SUCCEEDED (torchx exits 0) and the losses stay within 1e-5 of the failure-free R=4 run
(`ref4`: the trajectory depends on seed, data and N only). Skipped, with the reason, where torchx
is not installed. Every wait is bounded; torchx's own process group and every process under it
are ended by PID whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.runs import BASE, Run, max_rel, read_jsonl, recover_train, two_free_ports
from recover import procs
from recover.app import cluster, rundir

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (it comes with torchx)")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
# Replicas computing 24x slower: the restarted one (a fresh torchrun and interpreter importing
# torch, 3.5 s here) must be back before the 14th step; at 6x the 13 steps after the kill took
# 3.2-4 s on a quiet 2-core host and the replacement came 15 ms after the run ended. Timing only:
# the trajectory is N's. In a settings file: torchx refuses a flag given twice (--fault).
# stale_s 5: the restarted replica rejoins on a loaded machine (three tests at a time), and its
# main thread's first steps there must not read as a stall; a kill is seen at once either way.
SLOW = ("[ft]\nstale_s = 5.0\nfaults = [" +
        ", ".join(f'"slow:replica={r},factor=24"' for r in range(3)) + "]\n")


def _wait_for(what: str, cond: Callable[[], bool], timeout_s: float,
              proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"torchx exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s}s"
        time.sleep(0.05)


def _hellos(out: Path) -> list[dict]:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return [e for e in read_jsonl(out / rundir.COORDINATOR_LOG) if e.get("event") == "hello"]
    return []


def _steps(out: Path) -> int:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return len(read_jsonl(out / rundir.METRICS))
    return 0


def _end(proc: subprocess.Popen) -> None:
    """torchx's process group, then whatever it had started (its replicas lead groups of their
    own), all by PID."""
    kids = procs.descendants(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    procs.kill_pids(kids + procs.descendants(proc.pid))
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.slow
def test_local_cwd_replica_restarts_and_rejoins(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchx", reason="torchx is not installed (pip install -e '.[torchx]')")
    out, port = tmp_path / "run", two_free_ports()
    (tmp_path / "slow.toml").write_text(SLOW)
    cmd = [str(BIN / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'tx'}",
           "recover.torchx:train", "--out", str(out), "--replicas", "3",
           "--port", str(port), "--max_retries", "1", "--wait_s", "120",
           "--", *BASE, "--config", str(tmp_path / "slow.toml"), "--no-report",
           "--tensorboard", "none", "--data", str(corpus)]
    # The roles find `recover` and `torchrun` on PATH, as on a cluster node: this venv's.
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tmp_path / "torchx.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_for("first step", lambda: _steps(out) >= 1, 150, proc)
        first = {e["replica"]: e["pid"] for e in _hellos(out)}
        victim = first[1]
        assert procs.alive(victim) and str(out) in Path(f"/proc/{victim}/cmdline").read_text()
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=150) == 0, log.read_text()[-4000:]
    finally:
        _end(proc)
    rows = read_jsonl(out / rundir.METRICS)
    assert [r["step"] for r in rows] == list(range(14))
    assert all(r["microbatches"] == 8 for r in rows)
    live = [r["live_replicas"] for r in rows]
    lost = live.index(2)  # the kill was seen ...
    assert 3 in live[lost:], live  # ... and the restarted replica came back
    again = [e["pid"] for e in _hellos(out) if e["replica"] == 1]
    assert len(again) == 2 and again[0] == victim != again[1], again
    exits = json.loads((out / rundir.REPLICA_EXITS).read_text())
    assert all("left cleanly" in exits[str(r)] for r in range(3)), exits
    assert max_rel([r["loss"] for r in rows], ref4.losses()) < 1e-5


# -- the recipes: rendered from the component's parameters ------------------------------------
# Other parameters than the examples', so a template that ignores one is caught.
JOB = cluster.ClusterJob(out="/mnt/runs/r7", replicas=5, ranks=2, port=31000, max_retries=2,
                         gloo_ifname="eth1", train_args=("--layout", "hsdp", "--shards", "2"),
                         wait_s=300, grace_s=90, image="reg.example/recover:1")


def test_examples_are_the_rendering() -> None:
    """examples/ holds exactly what `python -m recover.app.cluster` renders for its EXAMPLE."""
    assert (EXAMPLES / "slurm" / "recover.sbatch").read_text() == \
        cluster.slurm_script(cluster.EXAMPLE)
    assert (EXAMPLES / "kubernetes" / "recover.yaml").read_text() == \
        cluster.kubernetes_manifests(cluster.EXAMPLE)


def test_slurm_script(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(cluster.slurm_script(JOB))
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stderr
    text = script.read_text()
    for line in ("#SBATCH --nodes=5", "#SBATCH --requeue", "#SBATCH --signal=TERM@90"):
        assert line in text.splitlines()
    steps = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("srun ")]
    assert len(steps) == 2 and all("--kill-on-bad-exit=0" in s for s in steps)
    assert "for ((i = 0; i < 5; i++))" in text and "attempt <= 2;" in text
    [coordinator] = [ln for ln in text.splitlines() if "--external-workers" in ln]
    assert coordinator.split() == [*cluster.coordinator_argv(JOB), "$RESUME", "&"]
    [worker] = [ln for ln in text.splitlines() if "recover.app.train.worker" in ln]
    worker = worker.removesuffix(" && exit 0")
    assert shlex.split(worker) == cluster.worker_argv(JOB, "$COORD_HOST", "$i")


def test_kubernetes_manifests() -> None:
    docs = list(yaml.safe_load_all(cluster.kubernetes_manifests(JOB, name="r7")))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Service", "r7-coordinator"), ("NetworkPolicy", "r7-job-only"),
        ("Job", "r7-coordinator"), ("Job", "r7-replicas")]
    service, policy, coord, reps = docs
    # Only the job's pods reach any of its pods (the store, liveness and gloo ports).
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app": "r7"}
    job_pods = {"podSelector": {"matchLabels": {"app": "r7"}}}
    assert policy["spec"]["ingress"] == [{"from": [job_pods]}]
    assert service["spec"]["selector"]["app"] == "r7"
    assert [p["port"] for p in service["spec"]["ports"]] == [31000, 31001]
    assert service["spec"]["selector"] == coord["spec"]["template"]["metadata"]["labels"]
    assert coord["spec"]["backoffLimit"] == 0  # a new coordinator would be a new run
    spec = reps["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 5, 5)
    assert spec["backoffLimitPerIndex"] == 2
    for job in (coord, reps):
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 90
        assert pod["containers"][0]["image"] == "reg.example/recover:1"
    [c] = coord["spec"]["template"]["spec"]["containers"]
    assert c["command"] == cluster.coordinator_argv(JOB)
    [c] = spec["template"]["spec"]["containers"]
    assert c["command"] == ["bash", "-c",
                            cluster.worker_loop(JOB, "r7-coordinator", "$(RECOVER_REPLICA)")]
    env, token = c["env"]
    assert env["name"] == "RECOVER_REPLICA"
    assert "job-completion-index" in env["valueFrom"]["fieldRef"]["fieldPath"]
    # The run token comes from a Secret, in every pod, never from the shared volume.
    secret = {"name": "RECOVER_RUN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "r7-token",
                                                                           "key": "token"}}}
    assert token == secret
    assert coord["spec"]["template"]["spec"]["containers"][0]["env"] == [secret]


def test_component_commands() -> None:
    """The AppDef's roles run the same commands, the replicas' host being role 0's."""
    pytest.importorskip("torchx", reason="torchx is not installed (pip install -e '.[torchx]')")
    from torchx.specs import macros

    import recover.torchx as component

    app = component.train(*JOB.train_args, out=JOB.out, replicas=JOB.replicas, ranks=JOB.ranks,
                          port=JOB.port, max_retries=JOB.max_retries, gloo_ifname=JOB.gloo_ifname,
                          wait_s=JOB.wait_s, image=JOB.image)
    values = macros.Values(img_root="", app_id="a", replica_id="0", rank0_env="HEAD")
    roles = [values.apply(r) for r in app.roles]
    assert [r.name for r in roles] == ["coordinator", *(f"replica{i}" for i in range(5))]
    assert [(r.num_replicas, r.max_retries) for r in roles] == [(1, 0)] + [(1, 2)] * 5
    assert all(r.entrypoint == "bash" and r.args[0] == "-c" for r in roles)
    assert shlex.split(roles[0].args[1]) == ["exec", *cluster.coordinator_argv(JOB)]
    for i, role in enumerate(roles[1:]):
        assert role.args[1] == cluster.worker_loop(JOB, "${HEAD:-localhost}", str(i))


def test_worker_waits_for_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--wait-s`: a replica the scheduler started before the coordinator wrote DIR/config.json
    starts once it appears; past the wait it ends in the usual one line, exit 2."""
    from recover.app.config import preset
    from recover.app.train import loop, worker

    monkeypatch.setattr(loop, "run", lambda *_: 0)  # the training itself is not under test
    monkeypatch.setattr(worker.faulthandler, "register", lambda *_, **__: None)
    d = tmp_path / "run"
    d.mkdir()
    argv = ["--run-dir", str(d), "--replica", "0", "--coordinator", "127.0.0.1:29500"]
    t0 = time.monotonic()
    assert worker.main([*argv, "--wait-s", "0.3"]) == 2
    assert time.monotonic() - t0 >= 0.3
    assert "config.json" in capsys.readouterr().err
    config = preset("debug").replace(run={"out": str(d)}).to_json()

    def coordinator() -> None:  # as the launcher writes them: the token, config.json, and
        time.sleep(0.3)         # the coordinator's port once it listens
        (d / rundir.RUN_TOKEN).write_text("0123abcd\n")
        (d / "config.json").write_text(config)
        time.sleep(0.5)
        (d / rundir.COORDINATOR_PORT).write_text("29500")

    writer = threading.Thread(target=coordinator, daemon=True)
    writer.start()
    t0 = time.monotonic()
    assert worker.main([*argv, "--wait-s", "30"]) == 0
    assert 0.8 <= time.monotonic() - t0 < 10  # it waited for the port too, not for the 30 s
    writer.join(timeout=10)


def test_a_coordinator_that_cannot_listen_stops_its_workers(corpus: Path, tmp_path: Path) -> None:
    """`recover train --external-workers --port P` with P held by another socket (a port the
    kernel handed to someone else): the launcher ends in one line naming the cause, and a worker
    the scheduler started beside it, waiting for the coordinator, ends at once in one line,
    exit 2, rather than dialling P (whatever holds it) until its connect times out."""
    port = two_free_ports()
    out = tmp_path / "run"
    with socket.create_server(("0.0.0.0", port)):
        run = recover_train(out, *BASE, "--replicas", "2", "--external-workers", "--port",
                            str(port), data=corpus, timeout=120)
        assert run.returncode != 0
        last = run.stderr.strip().splitlines()[-1]
        assert "the coordinator did not start" in last and "in use" in last, run.stderr[-2000:]
        assert "Traceback" not in run.stderr
        assert (out / rundir.COORDINATOR_FAILED).is_file() and (out / rundir.CONFIG).is_file()
        t0 = time.monotonic()
        w = subprocess.run([sys.executable, "-m", "recover.app.train.worker", "--run-dir",
                            str(out), "--replica", "0", "--coordinator", f"127.0.0.1:{port}",
                            "--wait-s", "120"], capture_output=True, text=True, timeout=60)
    assert w.returncode == 2, w.stderr[-2000:]
    assert time.monotonic() - t0 < 30
    lines = w.stderr.strip().splitlines()
    assert len(lines) == 1 and "the coordinator did not start" in lines[0], w.stderr


def test_component_name_resolves_through_torchx_hook() -> None:
    """`recover.torchx:train` is found by TorchX's own finder (the `torchx.file` entry point the
    install registers), and TorchX's builtin components still are."""
    pytest.importorskip("torchx", reason="torchx is not installed (pip install -e '.[torchx]')")
    from torchx.specs.finder import get_component

    import recover.torchx as component

    found = get_component("recover.torchx:train")
    assert found.fn_name == "train" and not found.validation_errors
    assert get_component("dist.ddp").fn_name == "ddp"
    assert component.component_source("recover.no_such_module") is None
    assert component.component_source("torchx/components/dist.py") is not None
