"""The last save point's line is written when its writer died after the commit (issue 49, 4).

The replicas that do not write a save point offer `ckpt_pending` records; the sink waits for the
writer's (it carries the save's outcome) while the writer may still offer it. Once every replica
has exited nobody can: `poll(final=True)` takes the pending record. Here the store still lists the
dead writer as a member (the coordinator had not published its loss when the survivors left,
the race a real run loses now and then), so nothing but `final` can release the line.
"""

from __future__ import annotations

import io
import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from rich.console import Console
from torch.distributed import TCPStore

from recover.app import rundir
from recover.app.train.metrics import MetricsSink, seal_record
from recover.app.train.progress import ProgressView
from recover.control import keys

pytestmark = pytest.mark.timeout(60)
TOKEN = "a run token"


def _rec(step: int, pending: bool) -> dict:
    rec = {"step": step, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "microbatches": 4,
           "live_replicas": 2, "members": [0, 1], "quotas": {"0": 2, "1": 2}, "generation": 0,
           "recovered": [], "recovery_s": 0.0, "attempts": 1, "step_time_s": 0.1,
           "t_commit": time.time(), "mb_time_s": 0.01}
    if pending:
        rec["ckpt_pending"] = True
    return rec


def test_a_pending_last_line_is_taken_once_every_replica_exited(tmp_path: Path) -> None:
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5),
                     wait_for_workers=False)
    view = ProgressView(Console(file=io.StringIO(), width=200), 0, 2, quiet=True)
    sink = MetricsSink(store, tmp_path / rundir.METRICS, 0, 2, 1, 0.0, view, token=TOKEN)
    sink._members = lambda: [0, 1]  # type: ignore[method-assign]  # the writer 0 still listed
    for step, pending in ((0, False), (1, True)):  # replica 1's record of the last step
        store.set(keys.record_key(step), seal_record(TOKEN, step, _rec(step, pending)))
    assert sink.poll() == 1  # step 0; step 1 waits for its writer's record
    assert sink.poll() == 0
    assert sink.poll(final=True) == 1
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / rundir.METRICS).read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and "ckpt_pending" not in lines[1]
