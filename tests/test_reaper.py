"""A retired communicator is destroyed on the reaper thread, only after its work ended and its
last other reference went (collectives/reaper.py), and a real gloo group that failed mid-op is
retired, not destroyed, by the survivor's `reduce_` path."""

from __future__ import annotations

import datetime
import threading
import time

import torch
from torch.distributed import HashStore, ProcessGroupGloo

from recover.collectives import reaper


class Probe:
    """Records the thread its destructor ran on."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __del__(self) -> None:
        self.log.append(threading.current_thread().name)


def wait_until(cond, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_released_on_the_reaper_after_work_and_last_reference() -> None:
    log: list[str] = []
    before = reaper.held()  # earlier tests' groups whose work is still in flight stay held
    pg, work = Probe(log), Probe(log)
    fut: torch.futures.Future = torch.futures.Future()
    reaper.retire(pg, [work], [fut])
    del pg
    time.sleep(3 * reaper.REAP_POLL_S)
    assert log == []  # work in flight: held
    fut.set_result(None)
    time.sleep(3 * reaper.REAP_POLL_S)
    assert log == []  # the caller still holds a work: held (dropping it must not destroy)
    del work
    assert wait_until(lambda: len(log) == 2)
    assert log == ["recover-reaper", "recover-reaper"]
    assert wait_until(lambda: reaper.held() <= before)


def test_a_failed_gloo_group_is_destroyed_off_the_callers_thread() -> None:
    """Two ranks in threads: rank 1 leaves mid-op; rank 0's group is retired and released."""
    store = HashStore()
    timeout = datetime.timedelta(seconds=10)
    groups: dict[int, ProcessGroupGloo] = {}

    def build(rank: int) -> None:
        groups[rank] = ProcessGroupGloo(store, rank, 2, timeout)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert set(groups) == {0, 1}
    t = torch.ones(4)
    works = [groups[0].allreduce([t])]
    del groups[1]  # the peer's group goes: rank 0's op fails
    futs = [w.get_future() for w in works]
    assert wait_until(lambda: all(f.done() for f in futs), 15.0)
    pg = groups.pop(0)
    before = reaper.held()
    t0 = time.monotonic()
    reaper.retire(pg, works, futs)
    del pg, works
    assert time.monotonic() - t0 < 0.05  # never blocks on a destruction
    assert wait_until(lambda: reaper.held() <= before, 10.0)
