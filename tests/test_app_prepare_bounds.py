"""`recover prepare` streams (issue 50, item 7): memory bounded by a piece, not a document.

Invariant checked: one 8 MiB JSONL line tokenised by a byte-level BPE costs a bounded amount of
memory over a tiny corpus's (measured in the child's own `ru_maxrss`; before pieces it cost
~1 GB more, 1277 MiB in all for 7.3 MiB); a document cut into pieces gives exactly the tokens
of the whole (a byte-level pre-tokenizer, and bytes at any cut), the same document counts and
the end-of-text token once per document; a line past `MAX_LINE_BYTES` is refused unread, and a
nested, non-UTF-8 or non-string line is one line naming file and line, exit 2, no traceback.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recover.app import prepare_sources, prepare_tokens
from recover.app.prepare import run_cli
from recover.data import open_prepared

tokenizers = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.timeout(120)
WORDS = ["the", "of", "and", "recover", "replica", "step", "gradient", "é", "日本", "  ", "\n"]


def _text(n_words: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(n_words))


def _prepare(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str]:
    try:
        code = run_cli([str(a) for a in argv])
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def _tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> Path:
    (tmp_path / "small.txt").write_text(_text(20000, seed=1))
    code, err = _prepare(capsys, tmp_path / "small.txt", "--out", tmp_path / "tok",
                         "--train-tokenizer", 300, "--workers", 1)
    assert code == 0, err
    return tmp_path / "tok" / "tokenizer.json"


def _tokens(folder: Path) -> np.ndarray:
    p = open_prepared(folder)
    return np.concatenate([*p.splits["train"], *p.splits["val"]]).astype(np.int64)


_PEAK = ("import resource, sys\nfrom recover.app.prepare import run_cli\n"
         "code = run_cli(sys.argv[1:])\n"
         "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, code)\n")


def _peak_mib(*argv: object) -> int:
    """`recover prepare` in a fresh process: its peak RSS (MiB); it must succeed."""
    p = subprocess.run([sys.executable, "-c", _PEAK, *map(str, argv)], capture_output=True,
                       text=True, timeout=90)
    peak, code = p.stdout.split()[-2:]
    assert p.returncode == 0 and code == "0", p.stderr[-2000:]
    return int(peak)


def test_one_huge_line_needs_a_piece_of_memory(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    tok = _tokenizer(tmp_path, capsys)
    big = _text(3 * 1024 * 1024 // 6, seed=2)  # 3 MiB: ~450 MiB at 150x, the bound ~82
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": big}) + "\n")
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": _text(50)}) + "\n")
    base = _peak_mib(tmp_path / "tiny.jsonl", "--out", tmp_path / "o1", "--tokenizer", tok,
                     "--workers", 1)
    peak = _peak_mib(tmp_path / "big.jsonl", "--out", tmp_path / "o2", "--tokenizer", tok,
                     "--workers", 1)
    mib = len(big.encode()) / 2 ** 20
    # The line, its text and a piece's tokenising: a few times the line, not ~150 times it.
    assert peak - base < 6 * mib + 64, (base, peak, mib)
    whole = np.asarray(tokenizers.Tokenizer.from_file(str(tok)).encode(
        big, add_special_tokens=False).ids, dtype=np.int64)
    got = _tokens(tmp_path / "o2")
    eos = json.loads((tmp_path / "o2" / "meta.json").read_text())["eos_id"]
    assert np.array_equal(got[:-1], whole) and got[-1] == eos  # <|endoftext|>, once


@pytest.mark.parametrize("mode", ["bytes", "bpe"])
def test_pieces_give_the_whole_documents_tokens(tmp_path: Path, mode: str,
                                                capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    how: list[object] = ["--bytes"] if mode == "bytes" else ["--tokenizer",
                                                              _tokenizer(tmp_path, capsys)]
    docs = [_text(n, seed=n) for n in (3, 900, 1, 2500, 40)] + ["x" * 5000]  # the last: no space
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "t.txt").write_text(_text(3000, seed=9))
    argv = [tmp_path / "t.txt", tmp_path / "d.jsonl", *how, "--shard-tokens", 2000,
            "--workers", 1]
    assert _prepare(capsys, *argv, "--out", tmp_path / "whole")[0] == 0
    monkeypatch.setattr(prepare_sources, "PIECE_CHARS", 256)
    monkeypatch.setattr(prepare_sources, "READ_BYTES", 100)
    monkeypatch.setattr(prepare_tokens, "CHUNK_CHARS", 700)  # tasks end mid-document too
    assert _prepare(capsys, *argv, "--out", tmp_path / "pieces")[0] == 0
    a, b = (json.loads((tmp_path / d / "meta.json").read_text()) for d in ("whole", "pieces"))
    assert a["splits"] == b["splits"] and a["splits"]["train"]["documents"] + 1 >= 7
    if mode == "bytes":  # exact at any cut; the no-space document is cut hard
        assert np.array_equal(_tokens(tmp_path / "whole"), _tokens(tmp_path / "pieces"))
    else:  # the hard-cut document may merge differently at its cuts: compare the rest
        wa, wb = _tokens(tmp_path / "whole"), _tokens(tmp_path / "pieces")
        eos = a["eos_id"]
        ends_a, ends_b = np.flatnonzero(wa == eos), np.flatnonzero(wb == eos)
        assert len(ends_a) == len(ends_b) == 7
        assert np.array_equal(wa[: ends_a[5] + 1], wb[: ends_b[5] + 1])


def test_bad_lines_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    good = json.dumps({"text": "fine"}) + "\n"
    cases = {
        "nested.jsonl": (good + '{"text": ' + "[" * 100000 + "]" * 100000 + "}\n",
                         "line 2 is JSON nested too deeply"),
        "utf.jsonl": (good.encode() + b'{"text": "\xff\xfe"}\n', "line 2 is not UTF-8"),
        "obj.jsonl": (good + good + '{"text": {"a": 1}}\n',
                      "line 3 has no string field 'text' (a JSON object"),
        "long.jsonl": (good + json.dumps({"text": "y" * 3000}) + "\n",
                       "line 2 is longer than 2,000 bytes"),
    }
    for name, (content, expected) in cases.items():
        monkeypatch.setattr(prepare_sources, "MAX_LINE_BYTES",
                            2000 if name == "long.jsonl" else 10 ** 9)
        f = tmp_path / name
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
        code, err = _prepare(capsys, f, "--bytes", "--out", tmp_path / "new", "--workers", 1)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert str(f) in err and expected in err, (expected, err)
        assert not (tmp_path / "new").exists()
