"""Bad input: one readable line, a non-zero exit, no traceback, nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    (["--microbatches", "0"], "--microbatches must be >= 1"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "9", "--microbatches", "8"], "cannot exceed --microbatches"),
    (["--data", "/nonexistent/corpus.txt"], "no such file"),
    (["--fault", "explode:replica=1"], "bad --fault"),
    (["--fault", "kill:replica=7,step=1"], "does not exist"),
    (["--fault", "kill:replica=1,step=3,phase=lunch"], "phase must be"),
    (["--store-shards", "-1"], "--store-shards must be in [0, 256]"),
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
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    code, err = _err(capsys, ["train", "--out", str(out)])
    assert code != 0 and "already holds a run" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_real_process_prints_no_traceback(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "recover", "train", "--replicas", "0",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == "recover train: error: --replicas must be >= 1 (got 0)"


def test_bad_log_level(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = _err(capsys, ["--log-level", "loud", "train", "--out", str(tmp_path / "o")])
    assert code == 2 and "--log-level" in err and "Traceback" not in err
    code, err = _err(capsys, ["train", "--log-level", "loud", "--out", str(tmp_path / "o")])
    assert code == 2 and "--log-level" in err
