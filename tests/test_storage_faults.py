"""A checkpoint save the storage refuses is reported, cleaned up and agreed on; never a crash.

Invariant checked: when a save fails (ENOSPC injected in one process), `save_checkpoint` raises
one `CheckpointError` and leaves no temp file and `latest` where it was; in a 2-rank hsdp leader
where only one rank's write fails, both ranks return the same `ckpt_error` from
`RankCheckpoints.save` (no hang, no partial publish), the next save succeeds, and the save on the
way out (`save_on_exit`) fails the same way. The real full
disk and read-only folder, in whole runs: tests/faults/test_storage.py.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

from harness.processes import session
from harness.runs import free_ports
from recover.app.config import preset
from recover.app.runtoken import run_token
from recover.app.train.checkpoint import files as ckpt_files
from recover.app.train.checkpoint.dcp import save_checkpoint, verify_checkpoint
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer
from recover.errors import CheckpointError
from recover.procs import Process

pytestmark = pytest.mark.timeout(120)
KEY = b"this run's token"
NO_SPACE = os.strerror(errno.ENOSPC)


def _enospc(*_: object) -> None:
    raise OSError(errno.ENOSPC, NO_SPACE)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cfg = preset("debug")
    cfg.model.n_layer, cfg.model.n_embd = 1, 32  # small: only the files' fate matters here
    model = build_model(cfg.model, 0)
    return model, build_optimizer(model, cfg)


@pytest.mark.parametrize("where", [(os, "fsync"), (ckpt_files, "write_manifest"),
                                   (ckpt_files, "publish")], ids=["data", "manifest", "publish"])
def test_failed_save_leaves_nothing(tmp_path: Path, where: tuple[object, str]) -> None:
    """A data file, the manifest or the publishing rename hits ENOSPC: one line, no leftovers."""
    model, opt = _model()
    save_checkpoint(tmp_path, 1, model, opt, {}, key=KEY)
    before = sorted(p.name for p in tmp_path.iterdir())
    with mock.patch.object(*where, side_effect=_enospc) as hit, \
            pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, 2, model, opt, {}, key=KEY)
    assert hit.called
    msg = str(e.value)
    assert "\n" not in msg and "step_00000002" in msg and NO_SPACE in msg, msg
    assert "MiB free on its file system" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no .tmp_*, no step_00000002
    assert (tmp_path / "latest").read_text() == "step_00000001\n"
    assert save_checkpoint(tmp_path, 2, model, opt, {}, key=KEY).name == "step_00000002"


def test_unwritable_folder_is_one_line(tmp_path: Path) -> None:
    model, opt = _model()
    with mock.patch.object(Path, "mkdir", side_effect=PermissionError(errno.EACCES, "denied")), \
            pytest.raises(CheckpointError, match="cannot save checkpoint .*PermissionError"):
        save_checkpoint(tmp_path / "ckpt", 1, model, opt, {}, key=KEY)
    assert not (tmp_path / "ckpt").exists()


def test_write_atomic_leaves_no_temp_file(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("step_00000001\n")
    with mock.patch.object(os, "fsync", side_effect=_enospc), pytest.raises(OSError):
        ckpt_files.write_atomic(tmp_path / "latest", "step_00000002\n")
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]
    assert (tmp_path / "latest").read_text() == "step_00000001\n"


@pytest.mark.parametrize("fault", ["data:1", "manifest:0"])
def test_hsdp_leader_agrees_a_save_failed(tmp_path: Path, fault: str) -> None:
    """data:1: only the second rank's shard hits ENOSPC (DCP's own write); manifest:0: every DCP
    write succeeded, then the publishing rank's meta.json hits ENOSPC."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_token(run_dir, create=True)
    port, ranks = free_ports(1), []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        for rank in range(2):
            ranks.append(session().start("_ckpt_ranks:main", [str(run_dir), str(port), str(rank),
                                                              fault],
                                         tmp_path / f"rank{rank}.log", env=env))
        for rank, p in enumerate(ranks):
            code = p.wait(90)
            assert code == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    finally:
        for p in ranks:  # by PID (a no-op for those that exited)
            _end(p)
    got = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]
    failing = int(fault.split(":")[1])
    assert got[failing]["fired"] >= 1 and got[1 - failing]["fired"] == 0, got
    for g in got:
        assert g["first"] == {"ckpt": 1} and g["retried"] == {"ckpt": 2}, g
        assert set(g["failed"]) == {"ckpt_error"} and "step_00000002" in g["failed"]["ckpt_error"]
        # Nothing of the failed save was published or left behind; `latest` did not move.
        assert g["after"] == [".latest.lock", "latest", "step_00000001"], g["after"]
        assert g["latest"] == "step_00000001"
    assert NO_SPACE in got[0]["failed"]["ckpt_error"]  # the writer names the cause
    # The save on the way out fails the same soft way, and publishes nothing.
    assert got[failing]["fired_on_exit"] >= 1, got
    assert all(set(g["on_exit"]) == {"ckpt_error"} for g in got), got
    assert not (run_dir / "ckpt" / "step_00000003").exists()
    assert not list((run_dir / "ckpt").glob(".tmp_*"))
    meta = verify_checkpoint(run_dir / "ckpt" / "step_00000002", run_token(run_dir))
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])


def _end(p: Process) -> None:
    if p.poll() is None:
        p.kill()
        p.wait(30)
