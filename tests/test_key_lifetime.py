"""The protocol owns its store keys' lifetime: on the library path alone (`recover coordinator`
and a loop on `recover.Replica`, no launcher, nothing of `recover.app` in the workers) the store's
key count stays flat over a long run (recovery/lifetime.py deletes a committed step's keys two
commits later). Without that deletion the count grows by ~2 keys a step (~600 here).

The workers are this file run as a script (`--worker`): two real processes, one replica each, a
tiny model, microbatches that are a function of their id. (The store shards' keys are checked
flat in-process: tests/test_control_plane.py, test_store_key_count_is_flat[2].)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

from harness.runs import own_loop

pytestmark = pytest.mark.timeout(120)

STEPS, N = 300, 4
EARLY = 10  # the step after which the first count is read
SLACK = 5  # keys the count may differ by (the bound)


def _worker(argv: list[str]) -> int:
    """One replica's loop, as a user writes it (docs/library.md, "A plain loop")."""
    import datetime

    import torch
    from torch.distributed import TCPStore

    from recover import Replica
    from recover.settings import FaultTolerance, ReplicaConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--result", type=Path, required=True)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = ReplicaConfig(coordinator=f"127.0.0.1:{a.port}", replica=a.replica,
                           ft=FaultTolerance(heartbeat_s=0.1, join_timeout_s=60.0,
                                             reduce_timeout_s=30.0))
    rep = Replica(model, N, config=config)
    store = TCPStore("127.0.0.1", a.port, is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=30))

    def compute(mb_id: int, j: int) -> float:
        g = torch.Generator().manual_seed(mb_id)
        x = torch.randn(8, 4, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        (loss / N).backward()
        return loss.item()

    counts: dict[int, int] = {}
    # One step more than counted: the other replica is still in the run when the count after
    # step STEPS is read (a replica that leaves makes a new generation: two keys more).
    for step in range(STEPS + 1):
        rep.step(step, compute)
        opt.step()
        opt.zero_grad()
        if a.replica == 0 and step + 1 in (EARLY, STEPS):
            # The other replica waits for us in the next step; our deletions (a background
            # thread) finish meanwhile: both counts see the same steady state.
            time.sleep(0.3)
            counts[step + 1] = store.num_keys()
    a.result.write_text(json.dumps(counts))
    rep.leave()
    return 0


def test_store_key_count_is_flat_on_the_library_path(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    own_loop(tmp_path, lambda r: [sys.executable, __file__, "--worker", "--replica", str(r),
                                  "--result", str(tmp_path / f"result{r}.json")], 2, 90.0, env)
    counts = {int(k): v for k, v in json.loads((tmp_path / "result0.json").read_text()).items()}
    assert counts[STEPS] <= counts[EARLY] + SLACK, counts


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.exit(_worker(sys.argv[2:]))


def test_a_stalled_deletion_thread_leaves_no_key_behind(caplog: pytest.LogCaptureFixture) -> None:
    """The deletion thread's client connect stalls (the 5 s DNS lookup torch's client can make,
    docs/MEASUREMENTS.md "TCPStore"; seen in a clean-clone CI run of the test above) while 60
    steps commit, far past the 16 queued jobs: once it connects, every commit's keys but the
    last two are deleted, none left behind and nothing logged. A real store; only the member
    around it is a stand-in."""
    import logging
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from recover.control import keys
    from recover.recovery.lifetime import KEEP, QUEUE_MAX, Committed, KeyLifetime

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    connected = threading.Event()

    class Stalled:
        """The member's store: its clone (the deletion thread's connect) waits for the test."""

        def clone(self) -> TCPStore:
            assert connected.wait(30), "the test never released the connect"
            return TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=10))

    class Member:
        replica, store, shard_ports = 0, Stalled(), []

    stats = {"store_deletes": 0}
    lifetime = KeyLifetime(Member(), 0, 1, stats)  # type: ignore[arg-type]
    steps = 4 * QUEUE_MAX - 4
    try:
        with caplog.at_level(logging.WARNING, logger="recover.recovery.lifetime"):
            for t in range(steps):
                server.set(keys.count_key(t, 0), "1")
                server.set(keys.decision_key(t, 0), keys.COMMIT)
                lifetime.committed(Committed(t, [{"gen": 0, "assign": {}}], True, 0, [0, 1]))
            # Every deletion queued or spilled is pending while the connect stalls.
            assert lifetime.pending("main") == 2 * (steps - KEEP)
            connected.set()
            deadline = time.monotonic() + 30
            while stats["store_deletes"] < 2 * (steps - KEEP) and time.monotonic() < deadline:
                time.sleep(0.01)
        left = {t for t in range(steps) if server.check([keys.count_key(t, 0)])}
        assert left == set(range(steps - KEEP, steps)), sorted(left)
        assert stats["store_deletes"] == 2 * (steps - KEEP)
        assert lifetime.pending("main") == 0 and lifetime.pending("shard") == 0
        assert not caplog.records, [r.getMessage() for r in caplog.records]
    finally:
        connected.set()
        lifetime.close()
