"""`recover prepare`: text, JSONL, Parquet and saved `datasets` inputs into token shards; a local
tokenizer of more than 65,536 tokens gives uint32 shards that `recover train --data` trains on;
each bad input is one line on stderr and exit 2, and leaves no folder behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.runs import recover_train
from recover.app import rundir
from recover.app.prepare import run_cli
from recover.data import open_prepared

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")

DOCS = ["First document.\n", "Second, longer document: with words.", "Dritte — ünïcödé."]


def _prepare(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """Run `recover prepare` in-process: (exit code, stderr)."""
    try:
        code = run_cli([str(a) for a in argv])
    except SystemExit as e:  # argparse's errors (UsageParser: one line, exit 2)
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def _tokens(folder: Path) -> np.ndarray:
    p = open_prepared(folder)
    return np.concatenate([*p.splits["train"], *p.splits["val"]])


def test_text_jsonl_parquet_and_dataset_inputs(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a.txt").write_text(DOCS[0])
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"body": DOCS[1], "id": 1}) + "\n\n")
    pq.write_table(pa.table({"body": [DOCS[2], ""]}), tmp_path / "c.parquet")
    code, err = _prepare(capsys, tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet",
                         "--bytes", "--text-field", "body", "--out", tmp_path / "out",
                         "--val-fraction", "0.1", "--workers", "2", "--shard-tokens", "20")
    assert code == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    text = "".join(DOCS).encode()
    assert bytes(_tokens(tmp_path / "out").astype(np.uint8)) == text  # in order, nothing lost
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    assert meta["splits"]["val"]["tokens"] == round(len(text) * 0.1)
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == len(text)
    train = [s for s in meta["shards"] if s["split"] == "train"]
    assert len(train) == 3 and sum(s["documents"] for s in train) == 3  # one document a shard
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    code, err = _prepare(capsys, tmp_path / "saved", "--bytes", "--out", tmp_path / "ds",
                         "--workers", "1")
    assert code == 0, err
    assert bytes(_tokens(tmp_path / "ds").astype(np.uint8)) == text


def test_trained_tokenizer_is_saved_and_ends_each_document(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 200)
    code, err = _prepare(capsys, tmp_path / "a.txt", "--train-tokenizer", "300",
                         "--out", tmp_path / "out")
    assert code == 0, err
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    ids = _tokens(tmp_path / "out")
    assert meta["tokenizer"]["kind"] == "trained" and 257 <= meta["vocab_size"] <= 300
    assert ids[-1] == meta["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert tok.decode(ids[:-1].tolist()) == "the cat sat on the mat. " * 200


def _bad(tmp_path: Path) -> list[tuple[list[str], str]]:
    ok = tmp_path / "ok.txt"
    ok.write_text("text")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "fake.parquet").write_text("not parquet")
    (tmp_path / "rows.jsonl").write_text('{"content": "x"}\n')
    (tmp_path / "broken.json").write_text('{"model": ')
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    out = ["--out", str(tmp_path / "new")]
    return [
        ([str(tmp_path / "missing.txt"), "--bytes", *out], "no such file or directory"),
        ([str(tmp_path / "empty.txt"), "--bytes", *out], "hold no text"),
        ([str(tmp_path / "latin1.txt"), "--bytes", *out], "is not UTF-8 text"),
        ([str(tmp_path / "fake.parquet"), "--bytes", *out], "not a readable Parquet file"),
        ([str(tmp_path / "rows.jsonl"), "--bytes", *out], "has no string field 'text'"),
        ([str(ok), "--tokenizer", str(tmp_path / "broken.json"), *out], "does not load"),
        ([str(ok), "--tokenizer", str(tmp_path / "none.json"), *out], "No such file"),
        ([str(ok), "--train-tokenizer", "100", *out], "must be an integer in [257, 4294967296]"),
        ([str(ok), "--train-tokenizer", "many", *out], "must be an integer"),
        ([str(ok), "--bytes", "--out", str(tmp_path / "used")], "is not an empty folder"),
        ([str(ok), *out], "one of the arguments --tokenizer --train-tokenizer --bytes"),
        ([str(tmp_path / "broken.json"), "--bytes", *out], "unsupported file type '.json'"),
    ]


def test_each_bad_input_is_one_line_and_exit_2(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    for argv, expected in _bad(tmp_path):
        code, err = _prepare(capsys, *argv)
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and err.startswith("recover prepare: error: "), err
        assert expected in err, (expected, err)
        assert "Traceback" not in err
        assert not (tmp_path / "new").exists()
    assert not list(tmp_path.glob(".new.tmp-*"))  # nothing half-written left beside it


def test_a_vocabulary_past_uint16_gives_uint32_shards_that_train(tmp_path: Path) -> None:
    """A local WordLevel tokenizer of 70,000 tokens: `recover prepare` writes uint32 shards;
    `recover train --data` grows the model's vocabulary to it and trains."""
    models, pre = pytest.importorskip("tokenizers.models"), tokenizers.pre_tokenizers
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    (tmp_path / "c.txt").write_text(" ".join(f"w{i}" for i in rng.integers(0, 70_000, 3000)))
    assert run_cli([str(tmp_path / "c.txt"), "--tokenizer", str(tmp_path / "tokenizer.json"),
                    "--out", str(tmp_path / "shards")]) == 0
    meta = json.loads((tmp_path / "shards" / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    assert _tokens(tmp_path / "shards").max() > 65_535
    run = recover_train(tmp_path / "run", "--preset", "debug", "--steps", "2", "--replicas", "1",
                        "--eval-every", "0", "--eval-microbatches", "1", "--microbatches", "2",
                        "--microbatch-size", "2", "--block-size", "32",  # 70,000 logits a token
                        data=tmp_path / "shards", timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((run.out / rundir.CONFIG).read_text())["model"]["vocab_size"] == 70_000
    assert [r["step"] for r in run.metrics()] == [0, 1]
