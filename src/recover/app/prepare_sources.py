"""Reading `recover prepare`'s inputs: files and folders as `Source`s, their documents as pieces.

Invariant: a corpus is read in the order given (a folder's files sorted), every document once, as
pieces of at most `PIECE_CHARS` characters: memory is bounded by a piece, not a document. A text
file is read in blocks, and a document longer than `PIECE_CHARS` is cut just before a whitespace
that precedes a word (where a byte-level pre-tokenizer splits anyway: the same tokens as whole;
with no such whitespace in reach, a hard cut, where a tokenizer may merge differently); bytes are
exact at any cut. A JSONL line longer than `MAX_LINE_BYTES` is refused unread (one line naming
file, line and limit), as is a line that is not UTF-8, not JSON (or nested past the parser's
depth), or whose field is not a string. Every input the user got wrong is one `DataError` line.
"""

from __future__ import annotations

import codecs
import importlib
import json
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.errors import DataError, first_line

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk's
# The longest text tokenised at once: a tokenizer holds a hundred bytes and more per character of
# it (the tokens' strings, offsets, the pre-tokenizer's splits: gigabytes for one long JSONL line),
# so a document is never handed over whole.
PIECE_CHARS = 1 << 18
READ_BYTES = 1 << 20  # a text file is read and decoded this much at a time
# A JSONL line is parsed whole (its text field is one JSON string): past this it is refused, not
# read. Peak memory is then about 4x this (the line, its text) plus a piece's tokenising.
MAX_LINE_BYTES = 128 << 20


def need(module: str) -> Any:
    """An optional dependency, or a one-line DataError naming the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"recover prepare needs {module.split('.')[0]}: install recover[data] "
                        "(pip install 'recover[data]')") from None


@dataclass
class Source:
    path: Path
    kind: str  # text, jsonl, parquet or dataset
    size: int | None = None  # bytes, for the progress bar's total (None: unknown)


def find_sources(inputs: list[str]) -> list[Source]:
    """Every input as a Source, checked to exist and be readable (a folder: its supported files,
    sorted, or a `datasets` folder saved with `save_to_disk`)."""
    out: list[Source] = []
    for name in inputs:
        path = Path(name).expanduser()
        if not path.exists():
            raise DataError(f"input {name}: no such file or directory")
        if path.is_dir() and any((path / m).is_file() for m in DATASET_MARKERS):
            out.append(Source(path, "dataset"))
            continue
        files = ([path] if not path.is_dir() else sorted(
            (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES),
            key=lambda p: p.relative_to(path).as_posix()))
        if not files:
            raise DataError(f"input {name}: a folder with no {', '.join(SUFFIXES)} files")
        for f in files:
            kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(
                f.suffix.lower(), "text" if f.suffix.lower() in TEXT_SUFFIXES else "")
            if not kind:
                raise DataError(f"input {f}: unsupported file type {f.suffix or '(none)'!r}; "
                                f"give {', '.join(SUFFIXES)} files or a saved datasets folder")
            try:
                with open(f, "rb") as fh:
                    fh.read(1)
                size = f.stat().st_size
            except OSError as e:
                raise DataError(f"cannot read input {f}: {e.strerror or e}") from None
            out.append(Source(f, kind, size if kind != "parquet" else None))
    return out


Piece = tuple[str, bool]  # (text, whether it ends its document)


def documents(sources: list[Source], text_field: str) -> Iterator[Piece]:
    """Every document's text, in order, in pieces of at most `PIECE_CHARS` characters (see the
    module): a text file is one document, a JSONL line or a Parquet / dataset row is one (its
    `text_field`). Empty documents are skipped."""
    for src in sources:
        try:
            for doc in _DOCS[src.kind](src.path, text_field):
                yield from _ends_marked(_pieces(doc))
        except OSError as e:
            raise DataError(f"cannot read input {src.path}: {e.strerror or e}") from None


def texts(sources: list[Source], text_field: str) -> Iterator[str]:
    """The pieces' texts alone (a tokenizer's training reads words; a cut is at a whitespace)."""
    return (text for text, _ in documents(sources, text_field))


def _ends_marked(pieces: Iterator[str]) -> Iterator[Piece]:
    """Each piece with whether it is its document's last (one piece of look-ahead)."""
    prev: str | None = None
    for p in pieces:
        if prev is not None:
            yield prev, False
        prev = p
    if prev:
        yield prev, True


def _pieces(doc: str | Iterator[str]) -> Iterator[str]:
    """A document (a string, or its text in blocks) as pieces of at most PIECE_CHARS (`_cut`),
    sliced by position: no copy of what is left of it per piece."""
    if isinstance(doc, str):
        rest = yield from _split(doc)
        if rest:
            yield rest
        return
    buf = ""
    for block in doc:
        buf = yield from _split(buf + block if buf else block)
    if buf:
        yield buf


def _split(text: str) -> Generator[str, None, str]:
    """Yield the whole pieces at the start of `text`; return what is left (<= PIECE_CHARS)."""
    pos = 0
    while len(text) - pos > PIECE_CHARS:
        cut = _cut(text, pos)
        yield text[pos:cut]
        pos = cut
    return text[pos:]


_BEFORE_WORD = re.compile(r"\s(?=\S)")


def _cut(text: str, pos: int) -> int:
    """Where the piece that starts at `pos` ends (len(text) - pos > PIECE_CHARS): before the last
    whitespace that precedes a non-space in its second half (`text[cut:]` starts " word", the
    pre-tokenizer's own boundary), else (none in reach) at PIECE_CHARS."""
    lo, hi = pos + PIECE_CHARS // 2, pos + PIECE_CHARS
    last = -1
    for m in _BEFORE_WORD.finditer(text, lo, hi + 1):  # +1: the look-ahead sees text[hi]
        last = m.start()
    return last if last > pos else hi


def _text_docs(path: Path, _field: str) -> Iterator[Iterator[str]]:
    blocks = _decoded_blocks(path)
    first = next(blocks, None)
    if first is not None:
        yield _chain_first(first, blocks)


def _chain_first(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _decoded_blocks(path: Path) -> Iterator[str]:
    """A text file's text, READ_BYTES at a time (non-empty blocks); one line if not UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    at = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(READ_BYTES)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise DataError(f"input {path} is not UTF-8 text (byte {at + e.start})") from None
            at += len(raw)
            if text:
                yield text
            if not raw:
                return


def _jsonl_docs(path: Path, field_: str) -> Iterator[str]:
    with open(path, "rb") as f:
        n = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                limit = (f"{MAX_LINE_BYTES >> 20} MiB" if MAX_LINE_BYTES >= 1 << 20 else
                         f"{MAX_LINE_BYTES:,} bytes")
                raise DataError(f"input {path} line {n} is longer than {limit} (recover "
                                "prepare's limit for one JSONL line): split the document, or "
                                "give it as a text file")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"input {path} line {n} is not UTF-8 (byte {e.start} of the "
                                "line)") from None
            del raw
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except RecursionError:
                raise DataError(f"input {path} line {n} is JSON nested too deeply to read"
                                ) from None
            except ValueError:
                raise DataError(f"input {path} line {n} is not JSON") from None
            del line
            text = row.get(field_) if isinstance(row, dict) else None
            if not isinstance(text, str):
                got = "missing" if not isinstance(row, dict) or field_ not in row else \
                    f"a JSON {_json_kind(text)}"
                raise DataError(f"input {path} line {n} has no string field {field_!r} ({got}; "
                                "choose the field with --text-field)")
            del row
            if text:
                yield text


def _json_kind(v: Any) -> str:
    return {dict: "object", list: "array", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def _check_column(path: Path, columns: list[str], field_: str) -> None:
    if field_ not in columns:
        raise DataError(f"input {path} has no column {field_!r} (it has "
                        f"{', '.join(columns) or 'none'}; choose one with --text-field)")


def _parquet_docs(path: Path, field_: str) -> Iterator[str]:
    pq = need("pyarrow.parquet")
    try:
        pf = pq.ParquetFile(path)
    except OSError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid: not a Parquet file
        raise DataError(f"input {path} is not a readable Parquet file: "
                        f"{first_line(e, 1000)}") from None
    _check_column(path, pf.schema_arrow.names, field_)
    for batch in pf.iter_batches(columns=[field_]):
        yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str) and t)


def _dataset_docs(path: Path, field_: str) -> Iterator[str]:
    datasets = need("datasets")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # a damaged folder: whatever datasets raises, one line
        raise DataError(f"input {path}: not a loadable saved dataset: "
                        f"{first_line(e, 1000)}") from None
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else (next(iter(ds)) if len(ds) == 1 else None)
        if split is None:
            raise DataError(f"input {path} holds splits {', '.join(ds)} and none is 'train': "
                            "save the split to prepare on its own")
        ds = ds[split]
    _check_column(path, list(ds.column_names), field_)
    for batch in ds.select_columns([field_]).iter(batch_size=1000):
        yield from (t for t in batch[field_] if isinstance(t, str) and t)


_DOCS = {"text": _text_docs, "jsonl": _jsonl_docs, "parquet": _parquet_docs,
         "dataset": _dataset_docs}
