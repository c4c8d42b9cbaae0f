"""Every window once per epoch under faults (issue #28's acceptance): a run of more than 3 epochs
over a small prepared corpus loses two of its three replicas and takes one back, and what its
ranks actually read (RECOVER_WINDOWS_LOG: one line per microbatch computed) shows every window
read exactly once per epoch, the same windows for an id whoever read it, and the losses within
1e-5 of the failure-free run (`--reference`).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import generated_text
from harness.runs import Run, max_rel, read_jsonl, recover_train
from recover.app import rundir
from recover.app.prepare import run_cli
from recover.data import TokenWindows, open_prepared

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
STEPS, N, B, BLOCK = 10, 8, 4, 64


def _reads(folder: Path, run_dir: Path) -> dict[int, set[str]]:
    """Microbatch id -> the distinct (epochs, windows) its readers logged in `run_dir`."""
    reads: dict[int, set[str]] = defaultdict(set)
    for f in folder.glob("windows.*.jsonl"):
        for line in read_jsonl(f):
            if line["run"] == str(run_dir):
                reads[line["id"]].add(json.dumps([line["epochs"], line["items"]]))
    return reads


def _check_epochs(reads: dict[int, set[str]], windows: int) -> None:
    assert set(range(STEPS * N)) <= set(reads), "an id of a committed step was never read"
    order: list[tuple[int, int]] = []
    for i in range(STEPS * N):
        assert len(reads[i]) == 1, f"id {i} read differently by its readers: {reads[i]}"
        epochs, items = json.loads(next(iter(reads[i])))
        order += zip(epochs, items, strict=True)
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for e, w in order:
        by_epoch[e].append(w)
    assert len(by_epoch) == 4 and [e for e, _ in order] == sorted(e for e, _ in order)
    for e in range(3):  # three whole epochs, then part of a fourth
        assert sorted(by_epoch[e]) == list(range(windows)), f"epoch {e}"
    assert len(set(by_epoch[3])) == len(by_epoch[3])


def test_every_window_once_per_epoch_through_kills_and_a_rejoin(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text(generated_text(6600, seed=28))
    assert run_cli([str(tmp_path / "c.txt"), "--bytes", "--out", str(tmp_path / "shards"),
                    "--workers", "1"]) == 0
    windows = len(TokenWindows(open_prepared(tmp_path / "shards").splits["train"], BLOCK))
    assert 3 < STEPS * N * B / windows < 4, windows
    logs = tmp_path / "reads"
    logs.mkdir()
    run: Run = recover_train(
        tmp_path / "run", "--preset", "debug", "--steps", str(STEPS), "--replicas", "3",
        "--microbatches", str(N), "--microbatch-size", str(B), "--eval-every", "0",
        "--eval-microbatches", "1", "--warmup-steps", "3", "--reference",
        "--fault", "kill:replica=1,step=2,phase=backward",
        "--fault", "kill:replica=2,step=4,phase=forward",
        "--fault", "restart:replica=1,step=6", data=tmp_path / "shards",
        env={**os.environ, "RECOVER_WINDOWS_LOG": str(logs)})
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["live_replicas"] for r in recs] == [3, 3, 2, 2, 1, 1, 2, 2, 2, 2]
    assert sum(len(r["recovered"]) for r in recs) > 0  # the killed ones' ids were recomputed
    assert recs[-1]["epoch"] == pytest.approx(STEPS * N * B / windows, abs=1e-6)
    assert recs[-1]["tokens_seen"] == STEPS * N * B * BLOCK
    ref = read_jsonl(run.out / rundir.REFERENCE / rundir.METRICS)
    assert max_rel(run.losses(), [r["loss"] for r in ref]) < 1e-5
    _check_epochs(_reads(logs, run.out), windows)
    _check_epochs(_reads(logs, run.out / rundir.REFERENCE), windows)
    assert _reads(logs, run.out) == _reads(logs, run.out / rundir.REFERENCE)
