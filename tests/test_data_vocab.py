"""A token id outside the model's vocabulary is one line and exit 2 before any process starts
(issue 50, LOW): every replica indexed past the embedding at once, which read as all fenced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recover.app.cli import main

pytestmark = pytest.mark.timeout(120)


def test_out_of_vocabulary_token_is_one_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog. " * 2000)
    shards = tmp_path / "shards"
    assert main(["prepare", str(tmp_path / "c.txt"), "--bytes", "--out", str(shards)]) == 0
    tokens = np.memmap(shards / "train_00000.bin", dtype=np.uint16, mode="r+")
    tokens[100] = 60000  # beyond the 256 byte tokens meta.json declares
    tokens.flush()
    del tokens
    capsys.readouterr()
    rc = main(["train", "--preset", "debug", "--steps", "2", "--replicas", "2", "--data",
               str(shards), "--out", str(tmp_path / "run"), "--no-report"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "token id 60000" in err, err
    assert "vocabulary of 256" in err and not (tmp_path / "run" / "logs" /
                                               "replica0.log").exists()
