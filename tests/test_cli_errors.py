"""Bad input: one readable line, a non-zero exit, no traceback, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recover.app import rundir
from recover.app.cli import main

pytestmark = pytest.mark.timeout(60)


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = int(e.code or 0)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("args, needle", [
    (["--preset", "huge"], "unknown preset"),
    (["--microbatches", "0"], "--microbatches must be in [1, "),
    (["--replicas", "0"], "--replicas must be in [1, "),
    (["--replicas", "9", "--microbatches", "8"], "cannot exceed --microbatches"),
    (["--data", "/nonexistent/corpus.txt"], "no such file"),
    (["--data", ""], "--data must not be empty"),
    (["--fault", "explode:replica=1"], "bad --fault"),
    (["--fault", "kill:replica=7,step=1"], "does not exist"),
    (["--fault", "kill:replica=1,step=3,phase=lunch"], "phase must be"),
    (["--fault", "kill:replica=1,step=3,microbatch=8"], "microbatch 8 does not exist"),
    (["--store-shards", "-1"], "--store-shards must be in [0, 256]"),
    # Findings of issue #26: each of these started a run that broke.
    (["--reduce-timeout-s", "0"], "--reduce-timeout-s must be in (0, "),
    (["--reduce-timeout-s", "1"], "--reduce-timeout-s (1) must exceed --stale-s (2)"),
    (["--join-timeout-s", "nan"], "--join-timeout-s must be a finite number (got nan)"),
    (["--stale-s", "inf"], "--stale-s must be a finite number"),
    (["--heartbeat-s", "1e300"], "--heartbeat-s must be in (0, 604800]"),
    (["--fault", "hang:replica=1,step=2,seconds=inf"], "seconds= must be a finite number"),
    (["--fault", "slow:replica=1,factor=inf"], "factor= must be a finite number"),
    (["--fault", "slow:replica=1,factor=nan"], "factor= must be a finite number (got nan)"),
    (["--fault", "kill:replica=1,step=2,step=3"], "step= given twice"),
    (["--steps", "99999999999999999999"], "--steps must be in [1, "),
    (["--seed", "-1"], "--seed must be in [0, "),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--grad-clip", "0"], "--grad-clip must be in (0, "),
    (["--port", "70000"], "--port must be in [0, 65535] (got 70000)"),
    (["--port", "65535"], "leaves no room"),
    (["--host", ""], "--host must not be empty"),
    (["--resume", "x"], "unrecognized arguments: x"),
])
def test_bad_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str],
                   needle: str) -> None:
    code, err = _err(capsys, ["train", "--out", str(tmp_path / "o"), *args])
    assert code != 0
    assert needle in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_odd_bin(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "tokens.bin"
    bad.write_bytes(b"\x01\x00\x02")
    code, err = _err(capsys, ["train", "--out", str(tmp_path / "o"), "--data", str(bad)])
    assert code != 0 and "uint16" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_resume_without_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _err(capsys, ["train", "--out", str(tmp_path / "o"), "--resume"])
    assert code != 0 and "no checkpoint" in err and "Traceback" not in err


def test_existing_run_is_not_overwritten(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / rundir.METRICS).write_text('{"step": 0}\n')
    code, err = _err(capsys, ["train", "--out", str(out)])
    assert code != 0 and "already holds a run" in err
    assert (out / rundir.METRICS).read_text() == '{"step": 0}\n'


def test_out_that_cannot_be_a_run_directory(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    """A file in its place, a file on its path, or a place no folder can be made: one line,
    before anything of the run exists (findings of issue #26: tracebacks from mkdir)."""
    a_file = tmp_path / "file"
    a_file.write_text("mine\n")
    for out, needle in ((a_file, "is a file, not a directory"),
                        (a_file / "sub", "is a file, not a directory"),
                        (Path("/proc/recover-run"), "cannot create a directory in /proc")):
        code, err = _err(capsys, ["train", "--out", str(out)])
        assert code == 2 and needle in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert a_file.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [a_file]


def _script(name: str) -> str:
    """A console script of this environment (`recover`), as a user runs it."""
    return str(Path(sys.executable).parent / name)


@pytest.mark.parametrize("argv, expect", [
    ([_script("recover"), "coordinator", "--replicas", "0", "--port", "0"],
     "recover coordinator: error: --replicas must be in [1, 65536] (got 0)"),
    ([sys.executable, "-m", "recover.app.train.worker", "--run-dir", ".", "--replica", "0",
      "--coordinator", "host:abc"],
     "python -m recover.app.train.worker: error: --coordinator 'host:abc' is not host:port "
     "(a port in [1, 65535])"),
    ([_script("recover"), "train", "--out", "{file}"],
     "recover train: error: --out {file} is a file, not a directory"),
])
def test_real_process_prints_one_line(tmp_path: Path, argv: list[str], expect: str) -> None:
    """The real entry points, as processes: exit 2 and exactly the one line, nothing started
    (the coordinator published nothing: it would log its start; the file is untouched)."""
    file = tmp_path / "taken"
    file.write_text("x")
    argv = [a.format(file=file) for a in argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVER_")}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert (p.returncode, p.stderr.strip()) == (2, expect.format(file=file)), p.stderr
    assert p.stdout == "" and file.read_text() == "x"
    assert sorted(tmp_path.iterdir()) == [file]


def test_bad_log_level(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _err(capsys, ["--log-level", "loud", "train", "--out", str(tmp_path / "o")])
    assert code == 2 and "--log-level" in err and "Traceback" not in err
    code, err = _err(capsys, ["train", "--log-level", "loud", "--out", str(tmp_path / "o")])
    assert code == 2 and "--log-level" in err
