"""`IdBatches`: a map-style dataset (or recover's prepared shards) in, `batch(mb_id)` out.

Invariant: `batch(mb_id, rank, ranks)` is a pure function of (dataset, B, seed, sampling, mb_id,
rank, ranks): microbatch `mb_id` is samples `mb_id x B .. mb_id x B + B - 1`, each read through
`EpochOrder` (`sampling="epoch"`: every item exactly once per epoch) or drawn at random with
replacement from the id's own generator (`"random"`). A rank of a layout that splits rows (HSDP's
shards) gets rows `[rank x B/ranks, (rank+1) x B/ranks)` of the same microbatch. So a replica that
recomputes a lost id reads what the lost one read, and a run's data order needs no checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from recover.data.order import EpochOrder, random_draws
from recover.data.tokens import TokenWindows, open_prepared
from recover.workload.ids import Stream

SAMPLINGS = ("epoch", "random")
SAMPLE_STREAM = Stream.SAMPLE  # id_seed's stream of random draws (the registry: `Stream`)


class IdBatches:
    """Microbatches of `microbatch_size` items of `dataset` (anything with `__len__` and
    `__getitem__`), addressed by global microbatch id. A `TokenWindows` dataset gives `(x, y)`
    LongTensors `[rows, block_size]` (y is x shifted by one token); any other dataset gives
    `collate(list of items)` (default: torch's `default_collate`)."""

    def __init__(self, dataset: Any, microbatch_size: int, seed: int, *,
                 sampling: str = "epoch", collate: Callable[[list], Any] | None = None,
                 stream: int = SAMPLE_STREAM) -> None:
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)} (got {sampling!r})")
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1 (got {microbatch_size})")
        self.dataset, self.size = dataset, len(dataset)
        if self.size < 1:
            raise ValueError("the dataset is empty: a microbatch needs at least one item")
        self.microbatch_size, self.seed, self.sampling = int(microbatch_size), int(seed), sampling
        self.collate = collate or torch.utils.data.default_collate
        self.stream = stream
        self.order = EpochOrder(self.size, self.seed)

    @classmethod
    def from_prepared(cls, path: str | Path, block_size: int, microbatch_size: int, seed: int, *,
                      split: str = "train", sampling: str = "epoch") -> IdBatches:
        """Windows of `block_size + 1` tokens of a folder written by `recover prepare`."""
        windows = TokenWindows(open_prepared(path).splits[split], block_size)
        return cls(windows, microbatch_size, seed, sampling=sampling)

    def rows(self, rank: int = 0, ranks: int = 1) -> slice:
        """The rows of every microbatch that rank `rank` of `ranks` takes (equal, contiguous)."""
        b = self.microbatch_size
        if ranks < 1 or not 0 <= rank < ranks or b % ranks:
            raise ValueError(f"rank {rank} of {ranks}: the microbatch's {b} rows must split "
                             "into equal parts")
        return slice(rank * b // ranks, (rank + 1) * b // ranks)

    def items(self, mb_id: int, rank: int = 0, ranks: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(epochs, items) that rank's rows of microbatch `mb_id` read. With `sampling="random"`
        the items are draws (a `TokenWindows`' random starts), and the epoch counts samples."""
        if mb_id < 0:
            raise ValueError(f"microbatch ids are >= 0 (got {mb_id})")
        b, part = self.microbatch_size, self.rows(rank, ranks)
        samples = np.arange(mb_id * b, mb_id * b + b, dtype=np.int64)[part]
        if self.sampling == "epoch":
            return self.order.locate(samples)
        high = self.dataset.n_starts if isinstance(self.dataset, TokenWindows) else self.size
        draws = random_draws(self.seed, mb_id, b, high, self.stream)[part]
        return samples // self.size, draws

    def batch(self, mb_id: int, rank: int = 0, ranks: int = 1) -> Any:
        """Microbatch `mb_id` (that rank's rows of it)."""
        _, items = self.items(mb_id, rank, ranks)
        if isinstance(self.dataset, TokenWindows):
            w = (self.dataset.windows(items) if self.sampling == "epoch"
                 else self.dataset.at_starts(items))
            return _split(w)
        return self.collate([self.dataset[int(i)] for i in items])

    def epoch(self, microbatches: int) -> float:
        """Epochs read after `microbatches` microbatches (2.5: two epochs and half the third)."""
        return microbatches * self.microbatch_size / self.size


def _split(w: Tensor) -> tuple[Tensor, Tensor]:
    # x and y are copied out of the one gathered window so neither aliases the other.
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()
