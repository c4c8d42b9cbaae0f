"""gloo's full-mesh rendezvous through `MeshStore`: O(1) store requests per member, the same bytes.

Real gloo groups (one per thread, over loopback) on a real TCPStore; every client's requests are
counted (`storecount.CountedStore`).
"""

from __future__ import annotations

import datetime
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo

from recover.collectives import reaper
from recover.collectives.meshstore import MeshStore
from recover.control.storecount import CountedStore, Tally

pytestmark = pytest.mark.timeout(60)


def build(size: int, batched: bool) -> tuple[dict[int, object], Tally, list[object]]:
    """`size` gloo members meeting on one store; their groups, the requests, the stores."""
    server = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=20))
    tally, groups, stores = Tally(keep_alive=True), {}, [server]
    lock = threading.Lock()

    def member(rank: int) -> None:
        client = CountedStore(dist.TCPStore("127.0.0.1", server.port, size, False,
                                            timeout=datetime.timedelta(seconds=20)),
                              tally, f"rank{rank}")
        store: object = PrefixStore("gen1/pos0/pg", client)
        if batched:
            store = MeshStore(store, size)
        opts = ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=20)
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = ProcessGroupGloo(store, rank, size, opts)
        with lock:
            groups[rank] = pg
            stores.append(store)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(groups) == size
    return groups, tally, stores


def all_reduce(groups: dict[int, object]) -> list[torch.Tensor]:
    xs = {r: torch.full((8,), float(r + 1)) for r in groups}
    works = [groups[r].allreduce([xs[r]]) for r in groups]  # type: ignore[attr-defined]
    for w in works:
        assert w.wait(datetime.timedelta(seconds=20))
    return list(xs.values())


@pytest.mark.parametrize("size", [3, 12])
def test_each_member_asks_the_store_three_times_whatever_the_size(size: int) -> None:
    groups, tally, _ = build(size, batched=True)
    # its own address, then one wait for every member's and one multi_get of them all
    assert [tally.total(f"rank{r}") for r in range(size)] == [3] * size
    want = size * (size + 1) / 2
    assert all(torch.equal(x, torch.full((8,), want)) for x in all_reduce(groups))


def test_without_it_gloo_asks_twice_per_member() -> None:
    """The figure the wrapper changes (so the test above can fail): 1 + 2R requests each."""
    groups, tally, _ = build(6, batched=False)
    assert [tally.total(f"rank{r}") for r in range(6)] == [1 + 2 * 6] * 6
    all_reduce(groups)


def test_other_keys_pass_through_and_a_missing_member_times_out() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    store = MeshStore(PrefixStore("p", server), 3)
    store.set("x", b"1")
    store.set("0/7", b"beyond the group")  # not a member's address: read as it is
    assert store.get("x") == b"1" and store.get("0/7") == b"beyond the group"
    assert store.add("n", 2) == 2 and store.batches == 0
    store.set("0/0", b"a")
    store.set("0/1", b"b")
    with pytest.raises(dist.DistStoreError):  # member 2 never published: bounded, not a hang
        store.wait(["0/0"], datetime.timedelta(seconds=0.5))
    store.set("0/2", b"c")
    assert [store.get(f"0/{r}") for r in (2, 0, 1)] == [b"c", b"a", b"b"]
    assert store.batches == 1  # one read served all three


def test_it_goes_with_its_group() -> None:
    """gloo holds the store through a C++ pointer only: what keeps it alive is its owner, and
    handed to the reaper beside the group nothing else holds it, so both are released."""
    groups, _, stores = build(2, batched=True)
    mesh = [s for s in stores if isinstance(s, MeshStore)]
    assert len(mesh) == 2
    sole = sys.getrefcount(object()) + 1  # a name, the call's argument
    held = mesh[0]
    stores.clear()
    mesh.clear()
    assert sys.getrefcount(held) <= sole  # gloo's pointer adds no Python reference
    before = reaper.held()
    reaper.retire(groups.pop(0), [held])
    del held
    groups.clear()
    deadline = time.monotonic() + 10
    while reaper.held() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reaper.held() == before


def test_an_address_is_the_same_size_whatever_the_group() -> None:
    """With GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER (set when `meshstore` is imported) gloo
    publishes no pair identifier per peer: each member reads R addresses of one size, so the
    store sends it O(R) bytes, not O(R^2)."""
    sizes = {}
    for size in (3, 12):
        _, tally, _ = build(size, batched=True)
        sizes[size] = tally.bytes_served("rank0") / size
    assert sizes[3] == sizes[12], sizes
