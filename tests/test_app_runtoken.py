"""A run token that is not one is one line, never a hang or a traceback (issue 50, LOW).

Invariant checked: `run_token` on a `run.token` that is not UTF-8, a FIFO (which a plain read
would wait on for ever), a directory, an oversized or an empty file raises one `ConfigError` line
at once; `recover export` on such a run directory ends in one line and exit 2; a good token is
read as written (stripped).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from recover.app import rundir
from recover.app.cli import main
from recover.app.config import preset
from recover.app.runtoken import ENV, MAX_BYTES, run_token
from recover.errors import ConfigError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def _bad(kind: str, path: Path) -> str:
    if kind == "binary":
        path.write_bytes(b"\xff\xfe\x00token\n")
        return "is not UTF-8 text"
    if kind == "fifo":
        os.mkfifo(path)
        return "is not a regular file"
    if kind == "folder":
        path.mkdir()
        return "is not a regular file"
    if kind == "huge":
        path.write_bytes(b"a" * (MAX_BYTES + 1))
        return f"longer than {MAX_BYTES} bytes"
    path.write_text("  \n")
    return "is empty"


@pytest.mark.parametrize("kind", ["binary", "fifo", "folder", "huge", "empty"])
def test_a_bad_token_file_is_one_line(tmp_path: Path, kind: str) -> None:
    expected = _bad(kind, tmp_path / rundir.RUN_TOKEN)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        run_token(tmp_path)
    assert time.monotonic() - t0 < 5  # a FIFO is never waited on
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["binary", "fifo"])
def test_export_with_a_bad_token_is_one_line(tmp_path: Path, kind: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.json").write_text(preset("debug").replace(run={"out": str(d)}).to_json())
    (d / "ckpt").mkdir()
    expected = _bad(kind, d / rundir.RUN_TOKEN)
    try:
        code = main(["export", "--run", str(d), "--out", str(tmp_path / "m.safetensors")])
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert "Traceback" not in err


def test_a_good_token_is_read_as_written(tmp_path: Path) -> None:
    (tmp_path / rundir.RUN_TOKEN).write_text("abc123\n")
    assert run_token(tmp_path) == b"abc123"
