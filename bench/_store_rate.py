"""The store server's own CPU cost per request, for `bench/scale.py`'s curve.

Invariant: the figure is the server process's CPU time (every thread, /proc) over a run in which
its only work is the requests counted, divided by their number; the clients are separate
processes, forked (`harness.scale.Children`), ended by PID in a `finally`, and every wait
is bounded.

Why: failure-free, every rank sends the one store server its step's requests (the count and the
decision wait) at about the same moment, so the server handles them one after another. Its cost
per request, times the job's requests per step, is what a step's control plane cannot go below
on one server, however fast each rank is; `recover simulate --scenario scale` charges it per
request to each store server (the shards' and the main one's,
`recover.app.sim.scale.store_serial_s`).
A rebuilt group's rendezvous also has the server send every member every member's address (O(R)
bytes each: gloo's pair identifiers), so `byte_cpu_s` measures its CPU per byte sent.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import cpu_seconds, fresh_dir
from harness.scale import Children, wait_for


def _serve(port_file: Path) -> int:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    port_file.write_text(str(store.port))
    time.sleep(600)  # ended by PID
    return 0


def _client(arg: tuple[int, int, int, Path]) -> int:
    """As a step: add to a count, then read a key that is there; `n` times."""
    return _run(arg, lambda store, i: (store.add(f"count/{i}", 1), store.get("go")))


def _reader(arg: tuple[int, int, int, Path]) -> int:
    """As a member of a big group reads every member's address: one multi_get; `n` times."""
    names = [f"value/{k}" for k in range(VALUES)]
    return _run(arg, lambda store, _i: store.multi_get(names))


def _run(arg: tuple[int, int, int, Path], one: Callable[[Any, int], object]) -> int:
    """A client process: say ready, wait for "go", then `one(store, i)` for i < n."""
    import torch.distributed as dist

    port, me, n, done = arg
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    store.set(f"ready/{me}", "1")
    store.wait(["go"])
    for i in range(n):
        one(store, i)
    done.with_suffix(f".{me}").write_text("done")
    return 0


VALUES, VALUE_BYTES = 64, 16 << 10  # one multi_get: 1 MiB, as 128 members' addresses at R ~ 1k


def byte_cpu_s(d: Path, clients: int = 4, reads: int = 100) -> float:
    """Server CPU seconds per byte of values it sends, over `clients` x `reads` multi_gets of
    VALUES values of VALUE_BYTES each (the requests' own cost included: one per MiB)."""
    def values(ctl: Any) -> None:
        for k in range(VALUES):
            ctl.set(f"value/{k}", os.urandom(VALUE_BYTES))

    cpu = _server_cpu(d, clients, _reader, reads, values)
    return cpu / (clients * reads * VALUES * VALUE_BYTES)


def request_cpu_s(d: Path, clients: int = 8, pairs: int = 1500) -> float:
    """Server CPU seconds per request, over `clients` x `pairs` x 2 requests."""
    return _server_cpu(d, clients, _client, pairs) / (clients * pairs * 2)


def _server_cpu(d: Path, clients: int, work: Callable[[tuple[int, int, int, Path]], int],
                n: int, prepare: Callable[[Any], None] | None = None) -> float:
    """The store server's CPU seconds (its process, every thread) while `clients` processes
    each run `work((port, client, n, done))` from the moment they are all ready."""
    fresh_dir(d)  # an earlier run's port file would send the clients to a dead port
    kids = Children()
    port_file, done = d / "store.port", d / "client.done"
    try:
        kids.call("server", _serve, port_file, d / "store.log")
        wait_for(port_file.exists, 60, "the store server's port")
        port = int(port_file.read_text())
        import torch.distributed as dist

        ctl = dist.TCPStore("127.0.0.1", port, is_master=False,
                            timeout=datetime.timedelta(seconds=60))
        if prepare is not None:
            prepare(ctl)
        for c in range(clients):
            kids.call(c, work, (port, c, n, done), d / f"client{c}.log")
        ctl.wait([f"ready/{c}" for c in range(clients)])
        c0 = cpu_seconds(kids.pid["server"])
        ctl.set("go", "1")
        wait_for(lambda: all(done.with_suffix(f".{c}").exists() for c in range(clients)), 120,
                 "the store clients")
        c1 = cpu_seconds(kids.pid["server"])
    finally:
        kids.stop(list(kids.pid))
    for c in range(clients):
        os.unlink(done.with_suffix(f".{c}"))
    return c1 - c0
