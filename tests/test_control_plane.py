"""The control plane at scale and in any precision, in-process (tests/_inproc.py's harness).

- A failure-free step costs each rank at most 4 store round trips (the engine's own, and its
  blocking key waits), whatever R and the positions per replica; 2 with one rank per replica,
  whose plan is implied by the last commit instead of read from the store.
- The store's key count stays flat over many steps: the protocol deletes old steps' keys
  (recovery/lifetime.py), the metrics sink the step records.
- With store shards a communicator's rendezvous asks the main store nothing.
- The reduce's verification is exact for bf16 and fp16 gradients and for N = 65,536 ids; beyond
  the proven limits the engine refuses to start, with a clear error.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from rich.console import Console

from harness.inproc import Fault, Harness
from recover.app import rundir
from recover.app.train.metrics import MetricsSink
from recover.app.train.progress import ProgressView
from recover.control import keys, shards
from recover.control.storecount import Tally, counting_connect
from recover.recovery.step import MAX_MICROBATCHES

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("replicas,positions,speed_aware", [(4, 1, True), (3, 2, False),
                                                              (3, 2, True)])
def test_at_most_four_store_round_trips_per_rank_per_step(tmp_path: Path, replicas: int,
                                                          positions: int,
                                                          speed_aware: bool) -> None:
    h = Harness(tmp_path, replicas, positions=positions, n=12, steps=6,
                speed_aware=speed_aware).run()
    h.check(list(range(replicas)))
    # The plan is implied by the last commit (no round trip) unless it depends on speeds that
    # the ranks of a replica may see differently (a bare StepEngine cannot know they agree;
    # recover.Replica makes them agree).
    implied = positions == 1 or not speed_aware
    for rank in h.ranks.values():
        per_step = [rank.ops[t] for t in range(1, h.steps)]  # step 0 also builds the group
        assert max(per_step) <= 4, (rank.name, per_step)
        if implied:  # count the verified result, then the decision
            assert max(per_step) == 2, (rank.name, per_step)
    # Entry 0 is in the store for the first step, and for every step it was not implied;
    # every rank implied the same plan (Harness.chain checks it against each rank's chain).
    stored = [t for t in range(h.steps) if h.read(keys.chain_key(t, 0)) is not None]
    assert stored == ([0] if implied else list(range(h.steps))), stored
    assert all(h.chain(t)[0]["gen"] == 0 for t in range(h.steps))


@pytest.mark.parametrize("replicas,positions,n_shards,speaker", [
    (4, 1, 3, False), (3, 2, 2, False), (3, 2, 2, True), (5, 3, 2, True)])
def test_store_shards_take_the_count_off_the_main_store(tmp_path: Path, replicas: int,
                                                        positions: int, n_shards: int,
                                                        speaker: bool) -> None:
    """With shards, each rank counts and waits on its shard (2 round trips), a shard's last
    counter too: it tells the coordinator (a liveness line), which decides on the main store
    and copies the decision into every shard. So no rank asks the main store anything in a
    failure-free step. (Speed-blind plans: a bare multi-rank engine would read a speed-aware
    plan, +1; `recover.Replica` implies it.) With a speaker per replica (recovery/decide.py)
    only position 0 asks anything: P on shard m % S, its siblings nothing."""
    h = Harness(tmp_path, replicas, positions=positions, n=12, steps=6, speed_aware=False,
                store_shards=n_shards, speaker=speaker).run()
    h.check(list(range(replicas)))
    for t in range(1, h.steps):
        per_rank = {rank.name: rank.ops[t] for rank in h.ranks.values()}
        want = {f"{r}.{p}": 2 if p == 0 or not speaker else 0
                for r in range(replicas) for p in range(positions)}
        assert per_rank == want, (t, per_rank)
        assert h.read(keys.count_key(t, 0)) is None  # the coordinator counts the shards
        for k in range(len(h.coord.shards)):
            mine = sum(1 for r in range(replicas) for p in range(positions)
                       if shards.shard_of(r, p, positions, n_shards) == k)
            if speaker:  # the speaker counts its P positions on shard m % S
                mine = positions * sum(1 for r in range(replicas) if r % n_shards == k)
            assert int(h.read(keys.count_key(t, 0), shard=k) or 0) == mine
            assert h.read(keys.decision_key(t, 0), shard=k) == h.decision(t, 0)


@pytest.mark.parametrize("n_shards,positions", [(0, 1), (2, 1), (2, 2)])
def test_store_key_count_is_flat(tmp_path: Path, n_shards: int, positions: int) -> None:
    """Old steps' keys are deleted (recovery/lifetime.py); with a speaker per replica too
    (positions=2: only position 0 counts, on shard m % S, and deletes there)."""
    steps = 150
    h = Harness(tmp_path, 3, n=6, steps=steps, records=True, store_shards=n_shards,
                positions=positions, speaker=positions > 1, speed_aware=False)
    sink = MetricsSink(h.store(), tmp_path / rundir.METRICS, 0, steps, 1, 0.0,
                       ProgressView(Console(quiet=True), 0, steps, quiet=True))
    counts: dict[int, int] = {}
    stop = threading.Event()

    def drain() -> None:  # the launcher's metrics sink (it deletes the records it wrote out)
        while not stop.is_set() and sink.next < steps:
            if sink.poll():
                counts[sink.next] = sum(s.num_keys() for s in (h.coord.store, *h.coord.shards))
            stop.wait(0.005)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    h.run(timeout_s=200)
    stop.set()
    t.join(10)
    assert all(sorted(r.results) == list(range(steps)) for r in h.ranks.values())
    assert all(res.microbatches == 6 for r in h.ranks.values() for res, _ in r.results.values())
    early = max(v for k, v in counts.items() if 20 <= k <= 40)
    late = max(v for k, v in counts.items() if k >= steps - 20)
    # Without deletion: ~3 keys more per step (~300 here). With it, what varies is how many
    # steps the ranks run ahead of the sink when it counts (a few under load, ~3 keys each).
    assert late <= early + 12, (early, late)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_verify(tmp_path: Path, dtype: torch.dtype) -> None:
    """v0.1 carried the trailer in the gradient's dtype: in bf16 the checksum arrived wrong and no
    step could commit. Now it travels apart, in float64."""
    h = Harness(tmp_path, 3, n=8, steps=3, numel=64, dtype=dtype).run()
    for rank in h.ranks.values():
        for res, grad in rank.results.values():
            assert res.microbatches == 8 and res.attempts == 1, res
            assert grad.dtype == dtype and bool(torch.isfinite(grad).all())


def test_65536_microbatches_verify(tmp_path: Path) -> None:
    # float64 gradients: the sum of these integer gradients over 65,536 ids needs 34 bits
    h = Harness(tmp_path, 2, n=65536, steps=1, numel=4, dtype=torch.float64).run(timeout_s=200)
    h.check([0, 1])  # exact sums, quotas summing to N, one commit, verified count and checksum


def test_limits_are_refused_clearly() -> None:
    from types import SimpleNamespace

    from recover.recovery import StepEngine

    member = SimpleNamespace(replica=0, replicas=4, store=None)
    comm = SimpleNamespace(position=0)
    with pytest.raises(ValueError, match="outside \\[1, 1048576\\]"):
        StepEngine(member, comm, torch.zeros(1), MAX_MICROBATCHES + 1)  # type: ignore[arg-type]
    member.replicas = (1 << 16) + 1
    with pytest.raises(ValueError, match="replicas exceed 65536"):
        StepEngine(member, comm, torch.zeros(1), 8)  # type: ignore[arg-type]


@pytest.mark.parametrize("n_shards", [0, 2])
def test_rendezvous_goes_to_the_shards(tmp_path: Path, n_shards: int,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With store shards, every communicator's rendezvous (barrier, gloo addresses, gloo's own
    exchange), the first build and the rebuild after a kill, asks the main store nothing: each
    position meets on shard position % S. Without shards (the control) it all goes there."""
    h = Harness(tmp_path, 3, positions=2, n=6, steps=3, store_shards=n_shards,
                faults=[Fault(1, 1, "compute", j=0)])
    tally = Tally(keep_keys=True)  # every client the ranks open, counted by server
    monkeypatch.setattr(keys, "connect_store", counting_connect(keys.connect_store, tally, h.port))
    h.run()
    h.check([0, 2])
    comm = re.compile(r"^gen(\d+)/pos(\d+)/")
    on_main = {k for k in tally.keys.get("main", ()) if comm.match(k)}
    gens = {int(m.group(1)) for k in on_main if (m := comm.match(k))}
    if n_shards == 0:
        assert gens == {0, 1} and any("/pg/" in k for k in on_main), sorted(on_main)[:5]
        return
    assert not on_main, sorted(on_main)[:5]
    ports = [int(s.port) for s in h.coord.shards]
    for p in range(2):
        seen = {m.groups() for k in tally.keys.get(f"shard:{ports[p % n_shards]}", ())
                if (m := comm.match(k))}
        assert {("0", str(p)), ("1", str(p))} <= seen, (p, sorted(seen))


def test_gloo_reads_every_members_address_in_one_request(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A communicator's build asks its store for gloo's addresses 3 times per member (its own,
    one wait, one multi_get: `collectives/meshstore.py`), not 1 + 2R; here 3 replicas of 2
    positions build generation 0 (3 members) and, after a kill, generation 1 (2): at most
    3 x (3 + 2) x 2 such requests in all (gloo alone would ask 2 x (21 + 10))."""
    h = Harness(tmp_path, 3, positions=2, n=6, steps=3, store_shards=2,
                faults=[Fault(1, 1, "compute", j=0)])
    tally = Tally()
    monkeypatch.setattr(keys, "connect_store", counting_connect(keys.connect_store, tally, h.port))
    h.run()
    h.check([0, 2])
    ports = [int(s.port) for s in h.coord.shards]
    asked = sum(tally.by_kind(f"shard:{p}").get("gen#/pos#/pg/#/#", 0) for p in ports)
    assert 0 < asked <= 3 * (3 + 2) * 2, asked
