"""KeyWaiter (control/waiter.py): a blocking read whose caller keeps showing progress.

The caller's thread is what the stalled-main-thread watchdog watches: it must never sit inside a
store connect, whose name lookup took a DNS timeout (5 s) after a coordinator restart and got a
healthy replica evicted as stalled (bench/soak.py --seed 50, run 149)."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from recover.control.waiter import KeyWaiter

pytestmark = pytest.mark.timeout(60)

SLOW_CONNECT_S = 1.5


class _SlowClone:
    """A store client whose `clone()` (a new connection) takes SLOW_CONNECT_S."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def clone(self) -> Any:
        time.sleep(SLOW_CONNECT_S)
        return self.inner.clone()


class _Watch:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def progress(self) -> None:
        self.calls.append(time.monotonic())


class _Member:
    """What KeyWaiter asks of a `Member`."""

    coordinator_lost = False

    def __init__(self, store: Any) -> None:
        self.store, self.watch = store, _Watch()

    def generation(self) -> int:
        return 0

    def notify_on_change(self, event: threading.Event, on: bool = True) -> None:
        pass


def test_a_slow_connect_never_holds_the_callers_thread() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False,
                           timeout=datetime.timedelta(seconds=30))
    member = _Member(_SlowClone(client))
    waiter = KeyWaiter(member)  # type: ignore[arg-type]
    setter = threading.Timer(0.2, lambda: client.set("k", "v"))
    setter.start()
    try:
        t0 = time.monotonic()
        assert waiter.get("k", 0, 20.0) == b"v"
        took = time.monotonic() - t0
    finally:
        setter.cancel()
        waiter.close()
    assert took >= SLOW_CONNECT_S * 0.9  # the helper did connect slowly: the case under test
    ticks = [t0, *member.watch.calls]
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert ticks[-1] - t0 > SLOW_CONNECT_S * 0.8, ticks
    assert max(gaps) < 0.5, f"the caller showed no progress for {max(gaps):.2f}s"
