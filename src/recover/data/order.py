"""Which item a sample reads: epochs without replacement, or random draws, keyed by id.

Invariant: `EpochOrder.locate(samples)` is a pure function of (seed, size, sample numbers): sample
`s` reads item `permute(s mod size)` of epoch `s // size`, where the permutation is a keyed
bijection of [0, size) drawn from (seed, epoch). So the samples of one epoch read every item
exactly once, whoever computes them, in whatever order, after whatever faults; a lookup costs
O(1) memory (no permutation of the whole corpus is ever built) and there is no state to save.
"""

from __future__ import annotations

import numpy as np

from recover.workload.ids import Stream, id_seed, mix64

ORDER_STREAM = Stream.ORDER  # id_seed's stream of the epoch keys (the registry: `Stream`)
ROUNDS = 6  # Feistel rounds: 3 give a pseudo-random permutation (Luby-Rackoff); 6 mix small sizes
_U64 = np.uint64
# Up to this many indices `permute` walks each with Python integers (a microbatch's samples);
# more go through numpy at once. Both give the same images (tests/test_data_order.py).
SMALL = 64


def _half_bits(size: int) -> int:
    """Bits of one Feistel half: the smallest even-split power of two domain holding `size`."""
    return max(1, ((size - 1).bit_length() + 1) // 2)


def _round_keys(key: int) -> list[int]:
    return [id_seed(key, r, stream=ORDER_STREAM) for r in range(ROUNDS)]


def _walk(y: int, size: int, h: int, keys: list[int]) -> int:
    """`permute` of one index with Python integers: the same rounds as the vectorised ones
    (`mix64` masks modulo 2^64 either way), for a microbatch's few samples, where numpy's
    per-call overhead would cost more than the arithmetic."""
    mask = (1 << h) - 1
    while True:
        left, right = y >> h, y & mask
        for k in keys:
            left, right = right, left ^ (mix64(right ^ k) & mask)
        y = (left << h) | right
        if y < size:  # cycle walking, as below
            return y


def permute(index: np.ndarray, size: int, key: int) -> np.ndarray:
    """The images of `index` (ints in [0, size)) under the bijection of [0, size) keyed by `key`.

    A balanced Feistel network over [0, 4^h) (4^h < 4 x size), restricted to [0, size) by cycle
    walking: an image outside is encrypted again until it lands inside, which a permutation of the
    larger domain always does (on average under 4 times). Why Feistel: it is a bijection by
    construction for any round function, so exactness does not rest on the hash's quality.
    """
    if size < 1:
        raise ValueError(f"cannot permute an empty range (size {size})")
    x = np.asarray(index, dtype=np.int64)
    if x.size and (x.min() < 0 or x.max() >= size):
        raise ValueError(f"indices must lie in [0, {size})")
    h = _half_bits(size)
    rounds = _round_keys(key)
    if x.size <= SMALL:
        return np.array([_walk(int(i), size, h, rounds) for i in x.flat],
                        dtype=np.int64).reshape(x.shape)
    mask = _U64((1 << h) - 1)
    keys = [_U64(k) for k in rounds]
    out = x.astype(np.uint64)
    todo = np.ones(out.shape, dtype=bool)
    while todo.any():
        y = out[todo]
        left, right = y >> _U64(h), y & mask
        for k in keys:
            left, right = right, left ^ (mix64(right ^ k) & mask)
        y = (left << _U64(h)) | right
        out[todo] = y
        todo[todo] = y >= _U64(size)
    return out.astype(np.int64)


class EpochOrder:
    """Sample `s` (a global sample number: microbatch id x B + row) -> (epoch, item) over a
    dataset of `size` items: each epoch a fresh permutation drawn from (seed, epoch)."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError(f"an epoch needs at least one item (size {size})")
        self.size, self.seed = int(size), int(seed)

    def epoch_key(self, epoch: int) -> int:
        return id_seed(self.seed, int(epoch), stream=ORDER_STREAM)

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epochs, items) of the given sample numbers (int64 arrays of their shape)."""
        s = np.asarray(samples, dtype=np.int64)
        epochs, pos = np.divmod(s, self.size)
        items = np.empty_like(pos)
        for e in np.unique(epochs):  # a microbatch spans at most two epochs
            sel = epochs == e
            items[sel] = permute(pos[sel], self.size, self.epoch_key(int(e)))
        return epochs, items

    def epoch_items(self, epoch: int) -> np.ndarray:
        """Every item of one epoch in reading order (for tests and tools; O(size) memory)."""
        return permute(np.arange(self.size), self.size, self.epoch_key(epoch))


def random_draws(seed: int, mb_id: int, count: int, high: int,
                 stream: int = Stream.SAMPLE) -> np.ndarray:
    """`count` integers in [0, high) drawn with replacement from microbatch `mb_id`'s own
    generator (PCG64 seeded by `id_seed(seed, mb_id, stream)`): recover's random windows."""
    rng = np.random.Generator(np.random.PCG64(id_seed(seed, mb_id, stream=stream)))
    return rng.integers(0, high, size=count)
