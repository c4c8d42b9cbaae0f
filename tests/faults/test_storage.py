"""Storage faults: the checkpoint folder is full, or cannot be written at all, in a real run.

Invariant checked: a storage fault is not a replica fault. Every replica trains to the last step
(`conftest.check_run`'s steps, microbatch counts and losses; survivors bitwise equal), each failed
save is reported on its step's metrics line (`ckpt_error`) and as one console line, leaves no
`.tmp_step_*` folder behind, and `latest` stays at the last save that succeeded (which loads).

The folder is a real tmpfs mounted at DIR/ckpt (root only: skipped where `mount` is not allowed),
sized from the failure-free reference's own checkpoint so that exactly one fits; "unwritable" is a
read-only mount (EROFS: as root, permission bits do not stop a write; a non-root user's EACCES
takes the same path). Each mount is undone in a `finally`, by the path it was made at.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from faults.conftest import Row, check_run, faulty, load_last_checkpoint, measure
from harness.runs import Run, bitwise_equal, max_rel

pytestmark = pytest.mark.timeout(200)
SAVES = [5, 10, 14]  # the checkpoint steps of a fault-matrix run (conftest.CKPT, 14 steps)


def _mount(where: Path, options: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")


def _umount(where: Path) -> None:
    p = subprocess.run(["umount", str(where)], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:  # still busy (a process of the run not yet gone): detach it
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@contextmanager
def tmpfs_at(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `where` (a new folder) for the block; skips the test if not allowed."""
    _mount(where, options)
    try:
        yield where
    finally:
        _umount(where)


def checkpoint_bytes(ref: Run) -> int:
    """What one checkpoint of a fault-matrix run takes: the reference run's final one."""
    (step,) = sorted((ref.out / "ckpt").glob("step_*"))
    return sum(f.stat().st_size for f in step.iterdir())


def failed_saves(run: Run) -> dict[int, str]:
    """Checkpoint step -> the error its step's metrics line reported."""
    return {r["step"] + 1: r["ckpt_error"] for r in run.metrics() if "ckpt_error" in r}


def assert_soft(run: Run, ckpt: Path, failed: list[int], why: str) -> None:
    """Failed saves, reported and cleaned up; nothing else about the run changed."""
    recs = run.metrics()
    errors = failed_saves(run)
    assert sorted(errors) == failed and all(why in e for e in errors.values()), errors
    assert all(r["live_replicas"] == 4 for r in recs), [r["live_replicas"] for r in recs]
    assert not any("ckpt_pending" in r for r in recs)
    console = [line for line in run.stderr.splitlines() if "cannot save checkpoint" in line]
    assert len(console) == len(failed), console
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp_")], \
        sorted(p.name for p in ckpt.iterdir())
    finals = run.finals()
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(bitwise_equal(finals[0], f) for f in finals.values()), "replicas diverged"


def test_disk_full(ref4: Run, corpus: Path, tmp_path: Path, record: Row) -> None:
    record.scenario = ("checkpoint disk full: DIR/ckpt a tmpfs with room for one checkpoint "
                       f"(saves at steps {', '.join(map(str, SAVES))})")
    record.expected = ("the saves that do not fit fail on the leader, are reported "
                       "(`ckpt_error` on the step's line, one console line) and removed; no "
                       "replica is lost; `latest` stays at step 5, which loads")
    size = checkpoint_bytes(ref4)
    with tmpfs_at(tmp_path / "run" / "ckpt", f"size={(size * 3 // 2) >> 10}k") as ckpt:
        run = faulty(tmp_path, corpus)
        record.measured = f"failed saves {sorted(failed_saves(run))}; " + measure(run)
        check_run(run, ref4, [0, 1, 2, 3], steps=len(ref4.metrics()))
        assert_soft(run, ckpt, SAVES[1:], "free on its file system")
        assert run.metrics()[4]["ckpt"] == 5  # the save that fit, on its step's line
        assert (ckpt / "latest").read_text() == "step_00000005\n"
        step, params = load_last_checkpoint(run.out)
        assert step == 5 and params


def test_unwritable_dir(ref4: Run, corpus: Path, tmp_path: Path, record: Row) -> None:
    record.scenario = ("checkpoint folder unwritable: DIR/ckpt a read-only mount (EROFS; "
                       "EACCES for a non-root user takes the same path)")
    record.expected = ("every save fails before writing anything, is reported, and training "
                       "goes on to the end with all 4 replicas; nothing written")
    with tmpfs_at(tmp_path / "run" / "ckpt", "ro,size=64k") as ckpt:
        run = faulty(tmp_path, corpus)
        record.measured = f"failed saves {sorted(failed_saves(run))}; " + measure(run)
        recs = run.metrics()
        assert [r["step"] for r in recs] == [r["step"] for r in ref4.metrics()]
        assert all(r["microbatches"] == 8 for r in recs)
        assert max_rel(run.losses(), ref4.losses()) < 1e-5
        assert_soft(run, ckpt, SAVES, "Read-only file system")
        assert not any(ckpt.iterdir())
