"""recover.data: the epoch order's bijection, and `IdBatches` over map-style datasets and shards.

Every item exactly once per epoch, for sizes that are and are not powers of two; the order a pure
function of (seed, epoch, sample), whoever asks and in whatever order; epochs and seeds differ;
a rank's rows are its slice of the same microbatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.app.config import RunConfig, preset
from recover.data import EpochOrder, IdBatches, TokenWindows, open_prepared, order, permute
from recover.errors import DataError


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_permute_is_a_bijection(size: int) -> None:
    images = permute(np.arange(size), size, key=12345)
    assert sorted(images.tolist()) == list(range(size))


def test_every_item_once_per_epoch_and_epochs_differ() -> None:
    order = EpochOrder(size=1000, seed=7)
    samples = np.arange(3500)  # 3.5 epochs
    epochs, items = order.locate(samples)
    assert epochs.tolist() == (samples // 1000).tolist()
    for e in range(3):
        assert sorted(items[epochs == e].tolist()) == list(range(1000))
    assert len(set(items[epochs == 3].tolist())) == 500  # a partial epoch repeats nothing
    assert not np.array_equal(order.epoch_items(0), order.epoch_items(1))
    assert not np.array_equal(order.epoch_items(0), EpochOrder(1000, seed=8).epoch_items(0))
    assert not np.array_equal(order.epoch_items(0), np.arange(1000))  # shuffled at all


def test_the_order_is_a_pure_function_of_the_sample() -> None:
    """Looked up one at a time, backwards, or by a fresh object: the same item."""
    whole = EpochOrder(777, seed=3).locate(np.arange(2000))[1]
    one_by_one = [int(EpochOrder(777, 3).locate(np.array([s]))[1][0])
                  for s in reversed(range(0, 2000, 37))]
    assert one_by_one[::-1] == whole[::37].tolist()


class Squares:
    """A map-style dataset (len and getitem only): item i is the pair (i, i*i)."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, i * i


def test_id_batches_read_each_item_once_per_epoch_in_any_order() -> None:
    data = IdBatches(Squares(), microbatch_size=5, seed=11)
    ids = list(range(30))  # 150 samples: 3 epochs of 50
    forward = {i: data.batch(i) for i in ids}
    backward = {i: IdBatches(Squares(), 5, 11).batch(i) for i in reversed(ids)}
    seen: list[int] = []
    for i in ids:
        x, sq = forward[i]
        assert torch.equal(x, backward[i][0]) and torch.equal(sq, x * x)  # default_collate
        seen += x.tolist()
    for e in range(3):
        assert sorted(seen[e * 50:(e + 1) * 50]) == list(range(50))
    assert data.epoch(30) == 3.0


def test_a_rank_reads_its_rows_of_the_same_microbatch() -> None:
    for sampling in ("epoch", "random"):
        data = IdBatches(Squares(), 6, seed=2, sampling=sampling)
        whole = data.batch(4)[0]
        parts = [data.batch(4, rank=r, ranks=3)[0] for r in range(3)]
        assert torch.equal(torch.cat(parts), whole)
    with pytest.raises(ValueError, match="equal parts"):
        data.rows(0, 4)


def test_random_sampling_draws_with_replacement() -> None:
    data = IdBatches(Squares(), 50, seed=5, sampling="random")
    drawn = data.batch(0)[0].tolist()
    assert len(set(drawn)) < 50 and drawn == data.batch(0)[0].tolist()


def _write_shards(folder: Path, shards: list[np.ndarray], dtype: str = "uint16") -> None:
    folder.mkdir()
    entries = []
    for k, s in enumerate(shards):
        name = f"train_{k:05d}.bin"
        s.astype(dtype).tofile(folder / name)
        entries.append({"file": name, "split": "train", "documents": 1, "tokens": len(s)})
    np.arange(40, dtype=dtype).tofile(folder / "val_00000.bin")
    entries.append({"file": "val_00000.bin", "split": "val", "documents": 1, "tokens": 40})
    (folder / "meta.json").write_text(json.dumps({
        "format": "recover-tokens", "version": 1, "dtype": dtype, "vocab_size": 1 << 17,
        "shards": entries}))


def test_windows_of_prepared_shards(tmp_path: Path) -> None:
    """Windows never cross a shard; an epoch reads each once, each token a target once."""
    shards = [np.arange(0, 50), np.arange(100_000, 100_033), np.arange(200_000, 200_009)]
    _write_shards(tmp_path / "p", shards, "uint32")
    prepared = open_prepared(tmp_path / "p")
    windows = TokenWindows(prepared.splits["train"], block_size=8)
    assert len(windows) == 6 + 4 + 1  # (len - 1) // 8 per shard
    assert windows[6].tolist() == list(range(100_000, 100_009))
    data = IdBatches.from_prepared(tmp_path / "p", block_size=8, microbatch_size=11, seed=0)
    x, y = data.batch(0)  # one microbatch = one epoch here
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert sorted(x[:, 0].tolist()) == sorted(windows.windows(np.arange(11))[:, 0].tolist())
    (tmp_path / "p" / "train_00001.bin").write_bytes(b"\0" * 8)
    with pytest.raises(DataError, match="train_00001.bin has 8 bytes"):
        open_prepared(tmp_path / "p")


def test_a_run_saved_before_epochs_keeps_random_windows(tmp_path: Path) -> None:
    """config.json without `data.sampling` was written when windows were random: a resume reads
    it so (and refuses the new default), instead of changing the run's data under it."""
    saved = json.loads(preset("debug").to_json())
    del saved["data"]["sampling"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert RunConfig.load(tmp_path / "config.json").data.sampling == "random"
    assert preset("debug").data.sampling == "epoch"


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 1 << 45), key=st.integers(0, (1 << 64) - 1),
       fractions=st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=40))
def test_small_lookups_walk_the_same_bijection(size: int, key: int,
                                               fractions: list[float]) -> None:
    """A microbatch's few samples are walked with Python integers (`order.SMALL`); the same
    indices among many more (numpy's vectorised rounds) land on the same items."""
    idx = np.array([int(f * size) for f in fractions], dtype=np.int64)
    big = np.concatenate([idx, np.zeros(order.SMALL, dtype=np.int64)])
    assert len(idx) <= order.SMALL < len(big)
    assert permute(idx, size, key).tolist() == permute(big, size, key)[:len(idx)].tolist()
