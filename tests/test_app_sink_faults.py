"""The launcher's metrics sink survives what the store and the disk hand it (issue 50, item 5).

Invariant checked: a step record in the store that is not JSON, is forged (written without the
run token), lacks a field or is another step's is ignored and logged, never raised, and the
replicas' sealed record written over it is the one written out; `metrics.jsonl` appends that the
file system refuses (ENOSPC, injected at `os.write`, also after part of a line went out) are
reported once, held, and written exactly once, whole and in order, when space returns, while the
sink keeps writing the console view; a failed end-of-run report file is one console line, a
refused first write of the run directory one error line; the launcher lifts its fd limit.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from rich.console import Console
from torch.distributed import TCPStore

from recover.app import rundir
from recover.app.train import launch, metrics, prepared, supervision
from recover.app.train.metrics import MetricsSink, seal_record
from recover.app.train.progress import ProgressView
from recover.control import keys, sealed

pytestmark = pytest.mark.timeout(60)
TOKEN = "a run token"


@pytest.fixture(autouse=True)
def _fresh_rate_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its keys' first rejection logged (the limit is per key, process-wide)."""
    monkeypatch.setattr(sealed, "_last_logged", {})


def _store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5),
                    wait_for_workers=False)


def _rec(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "microbatches": 4,
            "live_replicas": 1, "members": [0], "quotas": {"0": 4}, "generation": 0,
            "recovered": [], "recovery_s": 0.0, "attempts": 1, "step_time_s": 0.1,
            "t_commit": time.time(), "mb_time_s": 0.01}


def _sink(store: TCPStore, path: Path, steps: int) -> tuple[MetricsSink, io.StringIO]:
    buf = io.StringIO()
    view = ProgressView(Console(file=buf, width=200), 0, steps, quiet=True)
    return MetricsSink(store, path, 0, steps, 1, 0.0, view, token=TOKEN), buf


def _put(store: TCPStore, step: int, rec: dict[str, Any] | None = None) -> None:
    store.set(keys.record_key(step), seal_record(TOKEN, step, rec or _rec(step)))


@pytest.mark.parametrize("junk", [
    b"\xff\xfenot json", b"[1, 2]", json.dumps(_rec(0)).encode(),  # the last: unsealed
    seal_record(TOKEN, 0, {**_rec(0), "members": "0"}).encode(),   # sealed, malformed
    seal_record(TOKEN, 1, _rec(1)).encode(),                       # step 1's, at step 0
    seal_record(TOKEN, 0, {**_rec(0), "step": 1}).encode()],
    ids=["binary", "list", "unsealed", "malformed", "other-key", "other-step"])
def test_a_bad_record_is_ignored_until_the_real_one(tmp_path: Path, junk: bytes,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    store = _store()
    sink, _ = _sink(store, tmp_path / rundir.METRICS, 2)
    store.set(keys.record_key(0), junk)
    with caplog.at_level(logging.WARNING):
        assert sink.poll() == 0 and sink.poll() == 0  # no exception, nothing written
    assert any("rec/0" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / rundir.METRICS).exists()
    _put(store, 0)  # the replicas' own record replaces it (a `set`)
    _put(store, 1)
    assert sink.poll() == 2
    assert [r["step"] for r in metrics.read_metrics(tmp_path / rundir.METRICS)] == [0, 1]


def test_forged_records_are_logged_rate_limited(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    store = _store()
    sink, _ = _sink(store, tmp_path / rundir.METRICS, 1)
    with caplog.at_level(logging.WARNING):
        for i in range(200):
            store.set(keys.record_key(0), f"junk {i}")
            sink.poll()
    assert 1 <= sum("rec/0" in r.getMessage() for r in caplog.records) <= 2


class _Disk:
    """`os.write` on metrics.jsonl refused (ENOSPC) while `full`; `partial`: the first refused
    call writes half its bytes first (a disk filling mid-line)."""

    def __init__(self, path: Path) -> None:
        self.path, self.full, self.partial, self.refused = path, False, False, 0
        self.real = os.write

    def __call__(self, fd: int, data: Any) -> int:
        if self.full and os.path.realpath(f"/proc/self/fd/{fd}") == str(self.path.resolve()):
            self.refused += 1
            if self.partial:
                self.partial = False
                return self.real(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(fd, data)


@pytest.mark.parametrize("partial", [False, True], ids=["refused", "half-written"])
def test_full_disk_holds_lines_until_space_returns(tmp_path: Path, partial: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / rundir.METRICS
    store = _store()
    sink, console = _sink(store, path, 8)
    disk = _Disk(path)
    monkeypatch.setattr(metrics, "RETRY_S", 0.0)
    with mock.patch.object(os, "write", disk):
        for t in range(2):
            _put(store, t)
        assert sink.poll() == 2
        disk.full, disk.partial = True, partial
        for t in range(2, 6):
            _put(store, t)
            assert sink.poll() == 1  # the run goes on: the step is taken, its line held
        assert disk.refused >= 4 and len(sink.out.held) == 4
        assert console.getvalue().count("cannot append to") == 1  # reported once
        lines = path.read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [0, 1]  # no partial line left
        disk.full = False  # space returns
        assert sink.poll() == 0 and not sink.out.held
        for t in range(6, 8):
            _put(store, t)
        assert sink.poll() == 2
    assert [r["step"] for r in metrics.read_metrics(path)] == list(range(8))
    assert "wrote the 4 line(s) held" in console.getvalue()
    assert [r["step"] for r in sink.records] == list(range(8))


def test_still_full_at_the_end_is_one_line(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / rundir.METRICS
    store = _store()
    sink, console = _sink(store, path, 1)
    disk = _Disk(path)
    disk.full = True
    with mock.patch.object(os, "write", disk):
        _put(store, 0)
        assert sink.poll() == 1
        sink.close()
    assert "1 line(s) of" in console.getvalue() and len(sink.records) == 1


def test_end_of_run_report_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    buf = io.StringIO()
    with mock.patch.object(os, "fsync", side_effect=OSError(errno.ENOSPC, "No space left")):
        launch._write_report(tmp_path / rundir.EXIT_CODES, "{}\n", Console(file=buf))
    assert "cannot write" in buf.getvalue() and not list(tmp_path.iterdir())


def test_launcher_raises_its_descriptor_limit() -> None:
    """launch() lifts its soft open-files limit to the hard one, as the coordinator does (slow
    HTTP clients and the store's connections must not run it out of descriptors)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        with mock.patch.object(launch.foreign, "resolve", side_effect=RuntimeError("stop here")), \
                pytest.raises(RuntimeError, match="stop here"):
            launch.launch(mock.MagicMock(), Console(file=io.StringIO()))
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_full_disk_at_the_start_is_one_line(tmp_path: Path) -> None:
    """The run directory's first writes (config.json, the prepared data) refused: one line."""
    from recover.app.config import preset
    from recover.errors import RecoverError

    cfg = preset("debug").replace(run={"out": str(tmp_path / "run")})
    with mock.patch.object(launch, "prepare_run",
                           side_effect=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))), \
            pytest.raises(RecoverError) as e:
        launch._laid_out(cfg, Console(file=io.StringIO()))
    assert "\n" not in str(e.value) and "No space left" in str(e.value)
    assert "cannot write the run directory" in str(e.value)


def test_a_stop_reason_from_the_store_is_text() -> None:
    """`run/stopped` (any store client can write it) is shown as bounded text, never raised."""
    assert supervision.said(b"\xff\xfe below min\nreplicas") == "\ufffd\ufffd below min replicas"
    assert len(supervision.said(b"x" * 10**6)) == supervision.MAX_REASON + 3


class _FullFile(io.StringIO):
    """A console's file on a full disk."""

    def write(self, s: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_console_that_cannot_be_written_costs_no_line(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's output file on the full disk too: the console lines are lost, the
    metrics lines are not, and nothing is raised (a scheduler's output file, a closed pipe)."""
    path = tmp_path / rundir.METRICS
    store = _store()
    view = ProgressView(Console(file=_FullFile(), width=200), 0, 3, quiet=False)
    sink = MetricsSink(store, path, 0, 3, 1, 0.0, view, token=TOKEN)
    disk = _Disk(path)
    disk.full = True
    monkeypatch.setattr(metrics, "RETRY_S", 0.0)
    with mock.patch.object(os, "write", disk):
        for t in range(3):
            _put(store, t, {**_rec(t), "ckpt_error": "cannot save"} if t == 1 else None)
        assert sink.poll() == 3  # the refusal's report and every step line failed to print
        disk.full = False
        sink.close()
    assert [r["step"] for r in metrics.read_metrics(path)] == [0, 1, 2]
    prepared.say(Console(file=_FullFile()), "a line")  # the launcher's own lines: the same
