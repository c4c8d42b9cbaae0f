"""recover's one prepared-token format, and the training windows over it.

A prepared folder is `recover prepare`'s output, or the folder `recover train` tokenises a run's
data into (two shards, `train.bin` and `val.bin`, with where they came from in its meta.json).

Invariant: a prepared folder is read only through its `meta.json` (format `FORMAT`; `open_shards`
takes that description once read): every shard it lists must exist with exactly
`tokens x itemsize` bytes, or opening fails with one DataError line; shards are memory-mapped
read-only. `TokenWindows` cuts a split into fixed windows of `block_size + 1` tokens at stride
`block_size` (each token is a target once per epoch), never across a shard boundary; window
`i`'s tokens are a pure function of the shards and `i`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from recover.errors import DataError

FORMAT = "recover-tokens"  # meta.json's "format": a folder written by `recover prepare`
FORMAT_VERSION = 1
META = "meta.json"
MAX_META_BYTES = 64 << 20  # a meta.json lists shards; larger than this is not one of ours
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every token id of a vocabulary."""
    if not 1 <= vocab_size <= 1 << 32:
        raise DataError(f"a vocabulary of {vocab_size} tokens does not fit uint32 token ids")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_prepared(path: Path) -> bool:
    """Whether `path` is a folder whose meta.json says it holds recover's token shards."""
    meta = Path(path) / META
    try:
        if not meta.is_file() or meta.stat().st_size > MAX_META_BYTES:
            return False
        return json.loads(meta.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


@dataclass
class Prepared:
    """A prepared folder, opened: its meta and each split's shards (read-only memmaps)."""

    path: Path
    meta: dict[str, Any]
    splits: dict[str, list[np.ndarray]]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def open_prepared(path: str | Path) -> Prepared:
    """Open a folder written by `recover prepare`; DataError (one line) if it is not one or a
    shard is missing or of the wrong size."""
    root = Path(path).expanduser()
    try:
        meta = json.loads((root / META).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{root} holds no prepared tokens: {META} is missing or unreadable "
                        f"({getattr(e, 'strerror', None) or e}); make it with `recover prepare`"
                        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{root / META} is not a `recover prepare` meta.json")
    return open_shards(root, meta)


def open_shards(root: Path, meta: dict[str, Any]) -> Prepared:
    """The folder `root` as its `meta` (a `FORMAT` meta.json's contents) describes it; the
    DataErrors of `open_prepared`."""
    if meta.get("version") != FORMAT_VERSION or meta.get("dtype") not in DTYPES:
        raise DataError(f"{root / META}: format version {meta.get('version')!r} with dtype "
                        f"{meta.get('dtype')!r} is not one this recover reads (version "
                        f"{FORMAT_VERSION}, {' or '.join(DTYPES)}); prepare the corpus again")
    dtype = DTYPES[meta["dtype"]]
    splits: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    for shard in meta.get("shards", []):
        f, n, split = root / str(shard.get("file")), shard.get("tokens"), shard.get("split")
        if split not in splits or not isinstance(n, int) or n < 1 or Path(shard["file"]).name \
                != shard["file"]:
            raise DataError(f"{root / META}: a malformed shard entry {shard!r}")
        try:
            size = f.stat().st_size
        except OSError as e:
            raise DataError(f"prepared shard {f}: {e.strerror or e}") from None
        if size != n * dtype.itemsize:
            raise DataError(f"prepared shard {f} has {size} bytes, meta.json says {n} "
                            f"{meta['dtype']} tokens ({n * dtype.itemsize} bytes): prepare the "
                            "corpus again")
        splits[split].append(np.memmap(f, dtype=dtype, mode="r", shape=(n,)))
    if not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] < 1:
        raise DataError(f"{root / META}: vocab_size must be a positive integer")
    return Prepared(root, meta, splits)


class TokenWindows:
    """A split's training windows: a map-style dataset of LongTensors of `block_size + 1` tokens
    (input = all but the last, target = all but the first), `len()` of them per epoch.

    Random windows (`start`s over every valid position, overlapping) are read with `at_starts`:
    a start is a global position in the shards' concatenated valid starts.
    """

    def __init__(self, shards: Sequence[np.ndarray], block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        self.shards, self.block_size = list(shards), int(block_size)
        lengths = np.array([len(s) for s in self.shards], dtype=np.int64)
        counts = np.maximum((lengths - 1) // self.block_size, 0)  # whole windows per shard
        starts = np.maximum(lengths - self.block_size, 0)  # valid random starts per shard
        self.window_offsets = np.concatenate([[0], np.cumsum(counts)])
        self.start_offsets = np.concatenate([[0], np.cumsum(starts)])
        self.tokens = int(lengths.sum())

    def __len__(self) -> int:
        return int(self.window_offsets[-1])

    @property
    def n_starts(self) -> int:
        """Valid starts of a random (overlapping) window: the shards' lengths - block_size."""
        return int(self.start_offsets[-1])

    def __getitem__(self, i: int) -> Tensor:
        return self.windows(np.array([i]))[0]

    def windows(self, items: np.ndarray) -> Tensor:
        """The windows `items` as one LongTensor `[len(items), block_size + 1]`."""
        items = np.asarray(items, dtype=np.int64)
        if items.size and (items.min() < 0 or items.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)})")
        shard = np.searchsorted(self.window_offsets, items, side="right") - 1
        return self._gather(shard, (items - self.window_offsets[shard]) * self.block_size)

    def at_starts(self, starts: np.ndarray) -> Tensor:
        """The windows beginning at global random starts (see the class) `[k, block_size + 1]`."""
        starts = np.asarray(starts, dtype=np.int64)
        shard = np.searchsorted(self.start_offsets, starts, side="right") - 1
        return self._gather(shard, starts - self.start_offsets[shard])

    def _gather(self, shard: np.ndarray, offset: np.ndarray) -> Tensor:
        out = np.empty((len(shard), self.block_size + 1), dtype=np.int64)
        span = np.arange(self.block_size + 1)
        for k in np.unique(shard):  # one fancy-index gather per shard touched
            sel = shard == k
            out[sel] = self.shards[int(k)][offset[sel, None] + span]
        return torch.from_numpy(out)
