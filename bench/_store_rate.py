"""The store server's own CPU cost per request, for `bench/scale.py`'s curve.

Invariant: the figure is the server process's CPU time (every thread, /proc) over a run in which
its only work is the requests counted, divided by their number; the clients are separate
processes, forked (`recover.testing.scale.Children`), ended by PID in a `finally`, and every wait
is bounded.

Why: failure-free, every rank sends the one store server its step's requests (the count and the
decision wait) at about the same moment, so the server handles them one after another. Its cost
per request, times the job's requests per step, is what a step's control plane cannot go below
on one server, however fast each rank is; `recover simulate --scenario scale` charges it per
request to each store server (the shards' and the main one's, `recover.sim.scale.store_serial_s`).
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

from _common import cpu_seconds, fresh_dir
from recover.testing.scale import Children, wait_for


def _serve(port_file: Path) -> int:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    port_file.write_text(str(store.port))
    time.sleep(600)  # ended by PID
    return 0


def _client(arg: tuple[int, int, int, Path]) -> int:
    import torch.distributed as dist

    port, me, pairs, done = arg
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    store.set(f"ready/{me}", "1")
    store.wait(["go"])
    for i in range(pairs):  # as a step: add to a count, then read a key that is there
        store.add(f"count/{i}", 1)
        store.get("go")
    done.with_suffix(f".{me}").write_text("done")
    return 0


def request_cpu_s(d: Path, clients: int = 8, pairs: int = 1500) -> float:
    """Server CPU seconds per request, over `clients` x `pairs` x 2 requests."""
    fresh_dir(d)  # an earlier run's port file would send the clients to a dead port
    kids = Children()
    port_file, done = d / "store.port", d / "client.done"
    try:
        kids.call("server", _serve, port_file, d / "store.log")
        wait_for(port_file.exists, 60, "the store server's port")
        port = int(port_file.read_text())
        for c in range(clients):
            kids.call(c, _client, (port, c, pairs, done), d / f"client{c}.log")
        import torch.distributed as dist

        ctl = dist.TCPStore("127.0.0.1", port, is_master=False,
                            timeout=datetime.timedelta(seconds=60))
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
    return (c1 - c0) / (clients * pairs * 2)
