"""`examples/plain.py` (a DDP trainer ported to `Replica`) runs as docs/porting.md launches it.

One `torchrun --max-restarts 1` per replica beside `recover coordinator --exit-when-done`: replica
1's worker is SIGKILLed mid-run, torchrun restarts it, it receives the running replica's state
(the run token keys the transfer) and both replicas finish; the coordinator ends by itself, so
the recipe's `wait` returns; the leader wrote one snapshot per epoch (`rep.epochs`: the restarted
worker goes on in its epoch, and no epoch's snapshot is missing or written twice by it). And
every documented recipe that starts a coordinator and waits names `--exit-when-done`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "plain.py"


def _worker_pid(torchrun_pid: int) -> int | None:
    """The training process torchrun started (its descendant running the example)."""
    from recover import procs

    for pid in procs.descendants(torchrun_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"plain.py") for c in cmd) and not any(b"torchrun" in c for c in cmd):
            return pid
    return None


@pytest.mark.slow
def test_the_plain_example_survives_a_kill_and_a_torchrun_restart(tmp_path: Path) -> None:
    from harness.runs import free_ports
    from recover import procs

    port = free_ports(2)
    env = {**os.environ, "RECOVER_RUN_TOKEN": "plain-example", "SNAPSHOTS": str(tmp_path),
           "TORCH_CPP_LOG_LEVEL": "ERROR", "EPOCHS": "2"}  # ~2,000 steps: a rejoin's time
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    coord = procs.start([sys.executable, "-m", "recover", "coordinator", "--replicas", "2",
                         "--port", str(port), "--host", "127.0.0.1", "--exit-when-done",
                         "--log", str(tmp_path / "coordinator.jsonl")],
                        tmp_path / "coordinator.out", env=env)
    runs = [procs.start([torchrun, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                         str(EXAMPLE)], tmp_path / f"replica{r}.out",
                        env={**env, "RECOVER_COORDINATOR": f"127.0.0.1:{port}",
                             "RECOVER_REPLICA": str(r)}) for r in range(2)]
    try:
        log = tmp_path / "coordinator.jsonl"
        deadline = time.monotonic() + 60
        while not (log.exists() and '"generation"' in log.read_text()):
            assert time.monotonic() < deadline and coord.poll() is None
            time.sleep(0.05)
        time.sleep(1.0)  # mid-run: steps are being taken
        victim = _worker_pid(runs[1].pid)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)  # our grandchild, by its PID
        codes = [procs.wait_exit(p, 100.0) for p in runs]
        outs = [(tmp_path / f"replica{r}.out").read_text() for r in range(2)]
        assert codes == [0, 0], (codes, [o[-2000:] for o in outs])
        assert procs.wait_exit(coord, 15.0) == 0  # --exit-when-done: the recipe's wait returns
        events = [json.loads(line) for line in log.read_text().splitlines()]
        assert any(e.get("event") == "generation" and "admitted" in e.get("reason", "")
                   for e in events), events  # the restarted worker rejoined mid-run
        assert sorted(p.name for p in tmp_path.glob("snapshot_*.pt")) == \
            [f"snapshot_{e}.pt" for e in range(2)]
        for e in range(2):  # the leader's epoch-end line: once per epoch, across both replicas
            assert sum(o.count(f"plain: epoch {e} loss ") for o in outs) == 1, \
                [o[-2000:] for o in outs]
    finally:
        procs.stop_all([*runs, coord])


def test_every_recipe_that_starts_a_coordinator_and_waits_ends() -> None:
    """Every `recover coordinator ... &` in the README, docs/*.md and examples/*.py names
    `--exit-when-done`: without it the coordinator stays up after the run and `wait` never
    returns (issue 51's finding)."""
    root = EXAMPLE.parent.parent
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted((root / "examples").glob("*.py"))]
    recipes = [(f.name, line.strip()) for f in files for line in f.read_text().splitlines()
               if "recover coordinator" in line and re.search(r"&(\s|$)", line)]
    assert len(recipes) >= 5, recipes  # README, library.md (2), porting.md, common.py
    assert all("--exit-when-done" in line for _, line in recipes), recipes
