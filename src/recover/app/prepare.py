"""`recover prepare INPUT... --out DIR`: a corpus into recover's token shards. No network, ever.

Invariant: DIR appears complete or not at all: shards are written into a private sibling folder,
`meta.json` last, then renamed into place; its contents are a pure function of the inputs (in the
order given, a folder's files sorted), the tokenizer (its sha256 is in meta.json) and the flags,
whatever the number of worker processes (their results are written in submission order). Every
user mistake (a missing or unreadable input, an empty corpus, a tokenizer that does not load, a
bad vocabulary size, a missing optional dependency) is one line and exit 2.

The val split is the corpus's last `--val-fraction` of tokens (a document may straddle it). Each
document ends with the tokenizer's end-of-text token when it has one (meta.json's `eos_id`).

Memory is bounded by a piece, not a document: a text file is read in blocks, and a document
longer than `PIECE_CHARS` is tokenised in pieces cut just before a whitespace that precedes a
word (where a byte-level pre-tokenizer splits anyway: the same tokens as whole; with no such
whitespace in reach, a hard cut, where a tokenizer may merge differently); bytes are exact at any
cut. A JSONL line longer than `MAX_LINE_BYTES` is refused unread (one line naming file, line and
limit), as is a line that is not UTF-8, not JSON (or nested past the parser's depth), or whose
field is not a string.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import sys
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recover.data.tokens import DTYPES, FORMAT, FORMAT_VERSION, META, token_dtype
from recover.errors import ConfigError, DataError, ExitCode, RecoverError, UsageParser, usage_line
from recover.settings import Bounds

log = logging.getLogger(__name__)
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk's
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")  # GPT-2, Llama 3, Llama 2...
CHUNK_CHARS = 1 << 20  # text per task handed to a worker process
# The longest text tokenised at once: a tokenizer holds ~200 bytes per character of it (the
# tokens' strings, offsets, the pre-tokenizer's splits: measured 1.28 GB peak for one 7.3 MiB
# JSONL line before pieces), so a document is never handed over whole.
PIECE_CHARS = 1 << 18
READ_BYTES = 1 << 20  # a text file is read and decoded this much at a time
# A JSONL line is parsed whole (its text field is one JSON string): past this it is refused, not
# read. Peak memory is then about 4x this (the line, its text) plus a piece's tokenising.
MAX_LINE_BYTES = 128 << 20
WAIT_S = 600.0  # the longest one chunk of text may take to tokenise before we give up
MAX_VOCAB = 1 << 32  # uint32 token ids
MIN_TRAINED_VOCAB = 257  # the 256 bytes of byte-level BPE + <|endoftext|>
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
_TOKENIZER: Any = None  # the worker processes' tokenizer (set by `_start_worker`); None: bytes
_EOS: int | None = None


def _need(module: str) -> Any:
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
    pq = _need("pyarrow.parquet")
    try:
        pf = pq.ParquetFile(path)
    except OSError:
        raise
    except Exception as e:  # pyarrow's ArrowInvalid: not a Parquet file
        raise DataError(f"input {path} is not a readable Parquet file: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    _check_column(path, pf.schema_arrow.names, field_)
    for batch in pf.iter_batches(columns=[field_]):
        yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str) and t)


def _dataset_docs(path: Path, field_: str) -> Iterator[str]:
    datasets = _need("datasets")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # a damaged folder: whatever datasets raises, one line
        raise DataError(f"input {path}: not a loadable saved dataset: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
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


def chunks(docs: Iterator[Piece]) -> Iterator[list[Piece]]:
    """Pieces grouped into tasks of about CHUNK_CHARS characters (a task may end mid-document:
    its last piece then says so, and `ShardWriter.add` carries the document on)."""
    chunk: list[Piece] = []
    size = 0
    for d in docs:
        chunk.append(d)
        size += len(d[0])
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _start_worker(tokenizer_json: str | None, eos: int | None) -> None:
    """A worker process's tokenizer, rebuilt from its JSON (workers are spawned, see
    `tokenize_into`)."""
    global _TOKENIZER, _EOS
    _EOS = eos
    _TOKENIZER = None if tokenizer_json is None else \
        _need("tokenizers").Tokenizer.from_str(tokenizer_json)


def encode(chunk: list[Piece]) -> tuple[np.ndarray, np.ndarray, bool]:
    """(tokens, tokens per document or part of one, whether the last is left open) of a task,
    each document's last piece followed by the end-of-text token where the tokenizer has one.
    Runs in the worker processes (and in-process with one)."""
    texts_ = [text for text, _ in chunk]
    if _TOKENIZER is None:
        ids = [np.frombuffer(d.encode("utf-8"), dtype=np.uint8) for d in texts_]
    else:  # a batch of at most PIECE_CHARS at a time: the tokenizer's memory is per character
        ids = []
        for batch in _batches(texts_):
            ids += [np.asarray(e.ids, dtype=np.int64)
                    for e in _TOKENIZER.encode_batch(batch, add_special_tokens=False)]
    if _EOS is not None:
        ids = [np.append(i, _EOS) if ends else i for i, (_, ends) in zip(ids, chunk, strict=True)]
    lengths: list[int] = []
    run = 0  # tokens of the document (part) being summed
    for i, (_, ends) in zip(ids, chunk, strict=True):
        run += len(i)
        if ends:
            lengths.append(run)
            run = 0
    open_end = bool(chunk) and not chunk[-1][1]
    if open_end:
        lengths.append(run)
    tokens = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
    return tokens, np.array(lengths, dtype=np.int64), open_end


def _batches(texts_: list[str]) -> Iterator[list[str]]:
    """Consecutive texts, grouped up to PIECE_CHARS characters a group (one piece at least)."""
    batch: list[str] = []
    size = 0
    for t in texts_:
        if batch and size + len(t) > PIECE_CHARS:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += len(t)
    if batch:
        yield batch


@dataclass
class Shard:
    path: Path
    split: str
    tokens: int = 0
    documents: int = 0
    lengths: list[np.ndarray] = field(default_factory=list)  # tokens of each document in it

    def entry(self) -> dict[str, Any]:
        return {"file": self.path.name, "split": self.split, "documents": self.documents,
                "tokens": self.tokens}


class ShardWriter:
    """Appends tokens to train shards of at most about `shard_tokens` tokens (a shard ends at a
    document), then moves the last `val_fraction` of the tokens into the val shard."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int) -> None:
        self.folder, self.dtype, self.shard_tokens = folder, DTYPES[dtype], shard_tokens
        self.shards: list[Shard] = []
        self._open = False  # the last document added goes on in the next `add`

    def add(self, tokens: np.ndarray, lengths: np.ndarray, open_end: bool = False) -> None:
        """Append documents (`lengths` tokens each), starting a shard when one is full. The first
        length continues the document the previous call left open (it stays in its shard: a
        document is never cut, so a long one makes its shard longer); with `open_end` the last
        one goes on in the next call."""
        ends = np.cumsum(lengths)
        done = 0  # documents (parts) written
        shard = self.shards[-1] if self.shards else None
        while done < len(lengths):
            carried = done == 0 and self._open and shard is not None
            if shard is None:
                shard = Shard(self.folder / f"train_{len(self.shards):05d}.bin", "train")
                self.shards.append(shard)
            base = int(ends[done - 1]) if done else 0
            upto = int(np.searchsorted(ends, base + self.shard_tokens - shard.tokens, "right"))
            if carried:
                upto = max(upto, 1)
            elif upto <= done:  # the next document does not fit
                if shard.tokens:
                    shard = None
                    continue
                upto = done + 1  # a document larger than a shard fills one: it is never cut
            with open(shard.path, "ab") as f:
                f.write(tokens[base:int(ends[upto - 1])].astype(self.dtype).tobytes())
            shard.tokens += int(ends[upto - 1]) - base
            part = np.array(lengths[done:upto], dtype=np.int64)
            if carried:  # the open document's tokens: counted in its own entry
                shard.lengths[-1][-1] += part[0]
                part = part[1:]
            shard.documents += len(part)
            if len(part):
                shard.lengths.append(part)
            done = upto
        self._open = open_end

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def split_val(self, val_fraction: float) -> list[Shard]:
        """Move the last `val_fraction` of the tokens (at least one) into `val_00000.bin`; the
        train shards and the val shard, with their document counts."""
        item = self.dtype.itemsize
        want = max(1, round(self.tokens * val_fraction))
        val = Shard(self.folder / "val_00000.bin", "val", want)
        cut: list[tuple[Shard, int]] = []  # (shard, tokens it keeps), last shard first
        left = want
        for shard in reversed(self.shards):
            if left == 0:
                break
            keep = max(0, shard.tokens - left)
            cut.append((shard, keep))
            left -= shard.tokens - keep
        with open(val.path, "wb") as out:
            for shard, keep in reversed(cut):
                with open(shard.path, "rb") as f:
                    f.seek(keep * item)
                    shutil.copyfileobj(f, out)
        for shard, keep in cut:
            lengths = np.concatenate(shard.lengths)
            ends = np.cumsum(lengths)
            val.documents += int((ends > keep).sum())  # a document with a token in val
            shard.documents = int((ends - lengths < keep).sum())  # one that starts before
            os.truncate(shard.path, keep * item)
            shard.tokens = keep
        for shard in [s for s in self.shards if s.tokens == 0]:
            shard.path.unlink()
        return [s for s in self.shards if s.tokens] + [val]


@dataclass
class Tokenization:
    """The tokenizer a corpus is prepared with: its object (None: bytes) and what meta.json says."""

    tokenizer: Any
    vocab_size: int
    eos_id: int | None
    meta: dict[str, Any]


def load_tokenizer(name: str, out: Path) -> Tokenization:
    """A local tokenizer.json (or a folder holding one), copied into `out`."""
    tokenizers = _need("tokenizers")
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"--tokenizer {name}: {e.strerror or e}") from None
    try:
        tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own errors for bad JSON or an unknown model
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"--tokenizer {name} does not load as a Hugging Face tokenizer.json: "
                        f"{first}") from None
    (out / "tokenizer.json").write_bytes(raw)
    return _tokenization(tok, "file", raw, str(path))


def train_tokenizer(vocab: int, docs: Iterator[str], out: Path) -> Tokenization:
    """A byte-level BPE of `vocab` tokens (at most) trained on the corpus, saved into `out`."""
    tokenizers = _need("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS_TOKENS[0]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    raw = tok.to_str().encode("utf-8")
    (out / "tokenizer.json").write_bytes(raw)
    return _tokenization(tok, "trained", raw, f"byte-level BPE, {vocab} tokens asked")


def _tokenization(tok: Any, kind: str, raw: bytes, source: str) -> Tokenization:
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab < 1:
        raise DataError(f"the tokenizer ({source}) has an empty vocabulary")
    eos = next((i for i in map(tok.token_to_id, EOS_TOKENS) if i is not None), None)
    meta = {"kind": kind, "file": "tokenizer.json", "sha256": hashlib.sha256(raw).hexdigest(),
            "source": source, "eos": None if eos is None else tok.id_to_token(eos)}
    return Tokenization(tok, vocab, eos, meta)


BYTES = Tokenization(None, 256, None, {"kind": "bytes", "file": None, "sha256": None,
                                       "source": "UTF-8 bytes", "eos": None})


def _take(pending: deque, writer: ShardWriter, bar: Any) -> None:
    """Write the oldest task's tokens (bounded wait: a worker that hangs is an error)."""
    result, chars = pending.popleft()
    try:
        writer.add(*result.get(WAIT_S))
    except multiprocessing.TimeoutError:
        raise DataError(f"a tokenizer process gave no answer in {WAIT_S:g}s") from None
    bar.update(chars)


def tokenize_into(sources: list[Source], text_field: str, tz: Tokenization,
                  writer: ShardWriter, workers: int) -> None:
    """Tokenise every document into `writer`, on `workers` processes (spawned, each with the
    tokenizer rebuilt from its JSON), at most 2 tasks a worker in flight, results taken in
    submission order."""
    global _TOKENIZER, _EOS
    _TOKENIZER, _EOS = tz.tokenizer, tz.eos_id
    tqdm = _need("tqdm").tqdm
    sizes = [s.size for s in sources]
    total = None if None in sizes else sum(s for s in sizes if s is not None)
    docs = chunks(documents(sources, text_field))
    if workers <= 1:
        with tqdm(total=total, unit="B", unit_scale=True, desc="tokenising", disable=None) as bar:
            for chunk in docs:
                writer.add(*encode(chunk))
                bar.update(sum(len(text) for text, _ in chunk))
        return
    # Inherited by the workers: each encodes one document batch at a time, on one thread.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Spawned, not forked: a fork of a process with threads (the tokenizers library's pool, or
    # a caller's) can copy a lock some thread held, and the child waits on it for ever (forked
    # from the test process, a worker hung until the test's timeout).
    init = (None if tz.tokenizer is None else tz.tokenizer.to_str(), tz.eos_id)
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, init) as pool, \
            tqdm(total=total, unit="B", unit_scale=True, desc="tokenising", disable=None) as bar:
        pending: deque = deque()
        for chunk in docs:
            pending.append((pool.apply_async(encode, (chunk,)),
                            sum(len(text) for text, _ in chunk)))
            while len(pending) >= 2 * workers:
                _take(pending, writer, bar)
        while pending:
            _take(pending, writer, bar)


def check_out(out: Path) -> None:
    """ConfigError unless `out` is absent or an empty folder (a corpus is never mixed into
    another, nor written over one)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty folder: prepare into "
                          "a new one")


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenise `args.inputs` into `args.out` (see the module); meta.json's contents."""
    out = Path(args.out).expanduser()
    check_out(out)
    sources = find_sources(args.inputs)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise DataError(f"--out {out}: cannot create a folder beside it: {e.strerror or e}"
                        ) from None
    try:
        if args.tokenizer:
            tz = load_tokenizer(args.tokenizer, tmp)
        elif args.train_tokenizer:
            log.info("training a byte-level BPE of %d tokens on the corpus", args.train_tokenizer)
            tz = train_tokenizer(args.train_tokenizer, texts(sources, args.text_field), tmp)
        else:
            tz = BYTES
        writer = ShardWriter(tmp, token_dtype(tz.vocab_size), args.shard_tokens)
        tokenize_into(sources, args.text_field, tz, writer, args.workers)
        if writer.tokens < 2:
            raise DataError(f"the inputs hold {'no' if not writer.tokens else 'too little'} text "
                            f"({', '.join(args.inputs)}): nothing to train on")
        shards = writer.split_val(args.val_fraction)
        meta = _meta(args, tz, writer, shards)
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (check_out)
        os.replace(tmp, out)
    except OSError as e:
        raise DataError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it was renamed
    return meta


def _meta(args: argparse.Namespace, tz: Tokenization, writer: ShardWriter,
          shards: list[Shard]) -> dict[str, Any]:
    splits = {s: {"documents": sum(x.documents for x in shards if x.split == s),
                  "tokens": sum(x.tokens for x in shards if x.split == s)}
              for s in ("train", "val")}
    return {"format": FORMAT, "version": FORMAT_VERSION,
            "dtype": next(k for k, v in DTYPES.items() if v == writer.dtype),
            "vocab_size": tz.vocab_size, "eos_id": tz.eos_id, "tokenizer": tz.meta,
            "inputs": [str(Path(i).expanduser().resolve()) for i in args.inputs],
            "text_field": args.text_field, "val_fraction": args.val_fraction,
            "splits": splits, "shards": [s.entry() for s in shards]}


def _bounded(kind: type, bounds: Bounds) -> Any:
    """An argparse type: a number of `kind` within `bounds`, else argparse's one-line error."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
            bounds.check("value", value, kind is int)
        except (ValueError, ConfigError):
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what} {bounds.describe()} "
                                             f"(got {text!r})") from None
        return value
    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="recover prepare", description=(
        "Tokenise local text (.txt, .md), JSONL, Parquet files or a saved `datasets` folder into "
        "recover's token shards (uint16 up to 65,536 tokens, else uint32) for "
        "`recover train --data DIR`. Never uses the network."))
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders, in this order")
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", metavar="FILE",
                     help="a local Hugging Face tokenizer.json (or a folder holding one)")
    how.add_argument("--train-tokenizer", metavar="VOCAB",
                     type=_bounded(int, Bounds(MIN_TRAINED_VOCAB, MAX_VOCAB)),
                     help="train a byte-level BPE of at most VOCAB tokens on the corpus")
    how.add_argument("--bytes", action="store_true", help="UTF-8 bytes (vocabulary 256)")
    p.add_argument("--text-field", default="text",
                   help="the text field of JSONL, Parquet and dataset rows (default: text)")
    p.add_argument("--val-fraction", type=_bounded(float, Bounds(0.0, 0.5, True, True)),
                   default=0.05, help="last fraction of the tokens held out (default: 0.05)")
    p.add_argument("--shard-tokens", type=_bounded(int, Bounds(1, 1 << 40)),
                   default=100_000_000, help="tokens per shard, about (default: 100,000,000)")
    p.add_argument("--workers", type=_bounded(int, Bounds(1, 1024)), default=os.cpu_count() or 1,
                   help="tokenising processes (default: every core)")
    return p


def run_cli(argv: list[str]) -> int:
    """`recover prepare`: one summary line on stdout, or one error line on stderr and exit 2."""
    args = build_parser().parse_args(argv)
    os.environ.update(OFFLINE)  # before datasets or tokenizers is imported: never the network
    try:
        meta = prepare(args)
    except RecoverError as e:
        return usage_line("recover prepare", e)
    except KeyboardInterrupt:  # the pool and the half-written folder are gone already
        print("recover prepare: interrupted", file=sys.stderr)
        return 130
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    print(f"recover prepare: {tr['tokens']:,} train tokens ({tr['documents']:,} documents) and "
          f"{va['tokens']:,} val tokens in {len(meta['shards'])} {meta['dtype']} shards, "
          f"vocabulary {meta['vocab_size']:,}: {args.out}", flush=True)
    return ExitCode.OK
