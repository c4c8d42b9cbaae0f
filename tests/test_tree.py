"""The tree all-reduce for small payloads (collectives/tree.py), on real gloo groups: one per
thread, all on one store, as the ranks of a job would be."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch.distributed import HashStore, PrefixStore, ProcessGroupGloo

from recover.collectives.tree import TREE_MAX_BYTES, TreeDriver, fits

pytestmark = pytest.mark.timeout(60)


def _each(size: int, fn: Callable[[int], None]) -> None:
    """`fn(rank)` for every rank at once, one thread each (gloo's constructors and ops meet)."""
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            fn(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors


def _groups(size: int, timeout_s: float, prefix: str) -> list[ProcessGroupGloo]:
    """`size` gloo groups of one job on one store."""
    store = HashStore()
    out: dict[int, ProcessGroupGloo] = {}

    def build(r: int) -> None:
        out[r] = ProcessGroupGloo(PrefixStore(prefix, store), r, size,
                                  datetime.timedelta(seconds=timeout_s))

    _each(size, build)
    return [out[r] for r in range(size)]


def _close(drivers: list[TreeDriver]) -> None:
    """End the drivers' threads before the groups go: a gloo group destroyed before the works
    still issued on it aborts the process (the product hands both to `reaper.retire`, which
    drops the works first)."""
    for d in drivers:
        d.close(wait_s=10.0)
    assert all(d.pg is None for d in drivers)


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_every_member_ends_with_the_same_full_sum_op_after_op(size: int) -> None:
    pgs = _groups(size, 10.0, f"sum{size}")
    drivers = [TreeDriver(pgs[r], r, size, 10.0, f"tree{r}") for r in range(size)]
    # Values whose sums are exact in float32, different per rank, per element and per op.
    data = {(r, k): torch.arange(1000, dtype=torch.float32) * (r + 1) + k * 1000
            for r in range(size) for k in range(5)}
    out: dict[tuple[int, int], torch.Tensor] = {}

    def member(r: int) -> None:
        # All five submitted at once, then waited for: they run in order, matched by tag.
        mine = [data[r, k].clone() for k in range(5)]
        futs = [drivers[r].submit(t)[0] for t in mine]
        for k, f in enumerate(futs):
            f.wait()
            out[r, k] = mine[k]

    _each(size, member)
    for k in range(5):
        want = sum(data[r, k] for r in range(size))
        for r in range(size):
            assert torch.equal(out[r, k], want), (r, k)
    _close(drivers)


def test_a_member_that_never_comes_fails_the_others_within_the_timeout() -> None:
    size, timeout_s = 4, 1.0
    pgs = _groups(size, timeout_s, "absent")
    drivers = [TreeDriver(pgs[r], r, size, timeout_s, f"tree{r}") for r in range(size)]
    futs, t0 = [], time.monotonic()
    for r in (0, 2, 3):  # rank 1, the inner node, never submits
        futs.append(drivers[r].submit(torch.ones(10))[0])
    for f in futs:
        with pytest.raises(RuntimeError):
            f.wait()
    assert time.monotonic() - t0 < 3 * timeout_s + 2.0
    # The group is broken: a later operation fails at once, never meeting a peer's earlier one.
    t1 = time.monotonic()
    with pytest.raises(RuntimeError, match="earlier operation failed"):
        drivers[0].submit(torch.ones(10))[0].wait()
    assert time.monotonic() - t1 < 0.5
    _close(drivers)


def test_a_failed_operations_future_keeps_nothing_of_it_alive() -> None:
    """The future of an operation that failed holds an error, not the raised one's traceback:
    those frames hold the operation, so its works list, which the reaper waits to see let go
    (with the future) before it destroys the group: a cycle it broke only after 120 s."""
    size, timeout_s = 2, 0.5
    pgs = _groups(size, timeout_s, "cycle")
    d = TreeDriver(pgs[0], 0, size, timeout_s, "tree0")
    fut, kept = d.submit(torch.ones(4))  # rank 1 never comes: the receive times out
    with pytest.raises(RuntimeError):
        fut.wait()
    _close([d])
    gone = threading.Event()
    holder = type("Holder", (), {"__del__": lambda self: gone.set()})
    kept.append(holder())  # collected only when nothing but `kept` refers to it
    del kept
    assert gone.is_set(), "the failed operation's works are still referenced"


def test_close_fails_what_is_queued_and_lets_go_of_the_group() -> None:
    pgs = _groups(2, 5.0, "close")
    d = TreeDriver(pgs[0], 0, 2, 5.0, "tree0")
    first, kept = d.submit(torch.ones(4))  # would wait for rank 1, which never comes
    second, _ = d.submit(torch.ones(4))
    _close([d])
    for fut in (first, second):  # never attempted after the close, or timed out: bounded
        with pytest.raises(RuntimeError):
            fut.wait()
    assert kept and kept[0].numel() == 4  # the buffers stay referenced for the reaper
    with pytest.raises(RuntimeError, match="let go"):
        d.submit(torch.ones(4))[0].wait()
    del kept


def test_only_small_dense_cpu_tensors_take_the_tree() -> None:
    assert fits(torch.zeros(TREE_MAX_BYTES // 4))
    assert not fits(torch.zeros(TREE_MAX_BYTES // 4 + 1))
    assert not fits(torch.zeros(8, 8).t())  # not contiguous
    assert fits(torch.zeros(TREE_MAX_BYTES // 8, dtype=torch.int64))
