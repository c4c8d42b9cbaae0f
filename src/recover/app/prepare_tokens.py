"""Tokenising `recover prepare`'s pieces into token shards, on worker processes.

Invariant: the shards are a pure function of the pieces (in order), the tokenizer and the flags,
whatever the number of worker processes: their results are written in submission order. Each
document ends with the tokenizer's end-of-text token when it has one (meta.json's `eos_id`); a
shard ends at a document (one longer than a shard fills one, never cut), and the val split is
the corpus's last `--val-fraction` of tokens (a document may straddle it). Every wait on a worker
is bounded (`WAIT_S`).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recover.app import prepare_sources
from recover.app.prepare_sources import Piece, Source, documents, need
from recover.data.tokens import DTYPES
from recover.errors import DataError

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")  # GPT-2, Llama 3, Llama 2...
CHUNK_CHARS = 1 << 20  # text per task handed to a worker process
WAIT_S = 600.0  # the longest one chunk of text may take to tokenise before we give up
_TOKENIZER: Any = None  # the worker processes' tokenizer (set by `_start_worker`); None: bytes
_EOS: int | None = None


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
        need("tokenizers").Tokenizer.from_str(tokenizer_json)


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
        # The pieces' own bound, read where it is set: one knob for the pieces and the batches.
        if batch and size + len(t) > prepare_sources.PIECE_CHARS:
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
    tokenizers = need("tokenizers")
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
    tokenizers = need("tokenizers")
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
    tqdm = need("tqdm").tqdm
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
