"""Nothing a stranger writes into the store, and no full disk, ends `recover train` (issue 50,
item 5), in real runs.

Invariant checked: (1) a tokenless store client that writes non-JSON, unsealed and malformed
values to every step's record key `rec/{t}` before the replicas offer theirs is ignored (logged,
rate-limited): the run finishes every step once, on the failure-free trajectory (`ref4`'s losses
within 1e-5: the same seed, data and N), exit 0. (2) The whole run directory is a tmpfs that
fills up as the run starts (a filler takes every free byte, and what the run frees, for a few
seconds, then goes):
the run goes on, the refused `metrics.jsonl` appends are reported once per episode and written
when space returns, every step's line exactly once, in order, on the failure-free trajectory,
exit 0. The tmpfs needs root (skipped elsewhere); each
mount is undone in a `finally` by its path, every process ended by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from harness.runs import BASE, Launch, Run, max_rel
from recover.app import rundir
from recover.control import keys

pytestmark = pytest.mark.timeout(240)
STEPS = 14  # BASE's
SLOW = [f"slow:replica={r},factor=6,step=1" for r in range(2)]  # steps the stranger can meet


def _args(*faults: str) -> list[str]:
    args = [*BASE, "--replicas", "2"]
    for f in faults:
        args += ["--fault", f]
    return args


def _wait_for(what: str, cond: object, launch: Launch, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert launch.running(), f"the run ended waiting for {what}: {launch.stderr()[-3000:]}"
        time.sleep(0.05)


def _lines(out: Path) -> int:
    p = out / rundir.METRICS
    return len(p.read_text().splitlines()) if p.exists() else 0


def _check(run: Run, ref: Run) -> list[dict]:
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(STEPS)), [r["step"] for r in recs]
    assert all(r["microbatches"] == 8 for r in recs)
    assert max_rel(run.losses(), ref.losses()) < 1e-5
    return recs


def test_junk_step_records_are_ignored(ref4: Run, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    launch = Launch(out, *_args(*SLOW), data=corpus)
    try:
        _wait_for("the coordinator's port", (out / rundir.COORDINATOR_PORT).exists, launch)
        port = int((out / rundir.COORDINATOR_PORT).read_text())
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        forged = {"step": 0, "loss": 0.0, "microbatches": 8, "members": [0], "generation": 0,
                  "recovered": [], "attempts": 1, "step_time_s": 0.1, "t_commit": 0.0}
        junk = [b"\xff not json", b"[]", json.dumps(forged).encode(), b'{"step": "x"}']
        for t in range(STEPS):  # ahead of every step: the replicas' own `set` replaces each
            store.set(keys.record_key(t), junk[t % len(junk)])
        del store
    finally:
        run = launch.finish(200)
    recs = _check(run, ref4)
    assert all(r["loss"] != 0.0 for r in recs)  # no forged line
    assert "ignored the store's value of rec/" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr


def _mount(where: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")


def _umount(where: Path) -> None:
    p = subprocess.run(["umount", str(where)], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:  # still busy: detach it
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


class _Filler:
    """Keeps `folder`'s file system full: a file takes every free byte, and takes again what the
    run's processes free (a failed save's temp folder) every 10 ms, until `release()`."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "filler"
        self._f = open(self.path, "wb", buffering=0)  # noqa: SIM115 (closed in release)
        st = os.statvfs(folder)
        with contextlib.suppress(OSError):  # as much as it takes
            os.posix_fallocate(self._f.fileno(), 0, st.f_bavail * st.f_frsize)
        self._top_up()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _top_up(self) -> None:
        try:
            while self._f.write(b"\0" * 65536):
                pass
        except OSError:  # full
            pass
        try:
            while self._f.write(b"\0" * 512):
                pass
        except OSError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._top_up()

    def release(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._f.close()
        self.path.unlink()


def test_full_run_directory_holds_lines_until_space_returns(ref4: Run, corpus: Path,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "run"
    _mount(out, "512m")
    try:
        launch = Launch(out, *_args(*SLOW), data=corpus)
        filler: _Filler | None = None
        try:
            # Full before the first line: appending to a file's last page can still succeed
            # on a full tmpfs (its slack), so a file that already holds lines is no test.
            _wait_for("the coordinator's port", (out / rundir.COORDINATOR_PORT).exists, launch)
            filler = _Filler(out)
            _wait_for("the refused append's report",
                      lambda: "cannot append to" in launch.stderr(), launch)
            time.sleep(1.0)  # more steps commit meanwhile: their lines are held too
            assert launch.running(), launch.stderr()[-3000:]
        finally:
            if filler is not None:
                filler.release()  # space returns
            run = launch.finish(200)
        recs = _check(run, ref4)
        # Each episode reported once, and its end once (the run's own processes free pages
        # too: a failed save's temp folder; the filler takes them back within 10 ms).
        refused = run.stderr.count("cannot append to")
        assert refused >= 1, run.stderr[-3000:]
        assert run.stderr.count("line(s) held since the file system refused them") == refused
        assert len({r["step"] for r in recs}) == STEPS
    finally:
        _umount(out)
