"""A process without the run token writes forged control-plane values into a running job's store.

Invariant checked: whatever a tokenless client of the coordinator's store writes (a `commit-plan`
decision and forged chain entries that name step 0's microbatches for later steps, a pre-written
`redo`, a generation's members, the counters, rewritten `coord/*` parameters), the job trains
every step on the failure-free trajectory (the fault matrix's `check_run` against `ref4`) and
exits 0. A forged value is treated as absent (logged), never decides anything, kills nothing.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from faults.conftest import Row, check_run, fault_args, measure
from harness.runs import Launch, Run, two_free_ports
from recover.app import rundir
from recover.control import keys

pytestmark = pytest.mark.timeout(120)
N = 8  # microbatches a step (the debug preset)
STEPS = 14  # the fault matrix's steps (harness.runs.BASE)


def _connect(port: int, deadline: float):
    while True:
        try:
            return keys.connect_store("127.0.0.1", port, 5)
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _forged_chain(step: int) -> bytes:
    """Step `step`'s entry 0 as a forger writes it: step 0's microbatches, split over 2."""
    return json.dumps({"gen": 0, "assign": {"0": list(range(N // 2)),
                                            "1": list(range(N // 2, N))}}).encode()


FORGED_PARAMS = {keys.COORD_STALE_S: "0.001", keys.REPLICAS: "999", keys.SHARDS: "[1, 2, 3]",
                 keys.LIVENESS_ADDR: "127.0.0.1:1"}


def _attack(port: int, stop: threading.Event, wrote: list[str]) -> None:
    """Everything a tokenless client writes: what must be there before the run uses it (the
    next generations' members, the decisions and chains of later steps, a `redo`, a count of
    generations ahead of the coordinator's, the steps' counters by their documented names),
    then the coordinator's parameters and those generations' members, rewritten every 50 ms
    from the moment it publishes them (so a replica starting or joining reads forged ones) to the
    end."""
    deadline = time.monotonic() + 90
    store = _connect(port, deadline)

    def put(key: str, value: bytes | str) -> None:
        store.set(key, value)
        wrote.append(key)

    for g in range(1, 6):  # published at a failure, a join, as replicas leave
        put(keys.members_key(g), "[7777]")
    for t in range(2, STEPS - 1, 2):  # a `commit-plan` for t, then t + 1 trains step 0's ids
        for g in range(4):
            put(keys.decision_key(t, g), keys.COMMIT_PLAN)
        put(keys.chain_key(t + 1, 0), _forged_chain(t + 1))
    put(keys.decision_key(STEPS - 2, 0), keys.REDO)  # not a `commit-plan` one: a lone redo
    for t in range(1, STEPS):  # counts that never complete (or complete early) by their names
        for g in range(3):
            store.add(keys.count_key(t, g), 1000 if t % 2 else 1)
            store.add(keys.evidence_key(t, g, g + 1), 1000)
    store.add(keys.GEN_COUNT, 3)  # members read generations that were never published
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            if keys.try_get(store, keys.LIVENESS_ADDR) is not None:
                for key, value in FORGED_PARAMS.items():
                    put(key, value)
                for g in range(1, 6):  # also after their publication: a joiner reads them
                    store.set(keys.members_key(g), "[7777]")
            stop.wait(0.05)
    except Exception:  # the run ended: its store went with the coordinator
        return


def _attacked_run(tmp_path: Path, corpus: Path, replicas: int, *faults: str
                  ) -> tuple[Run, list[str]]:
    """One run of the fault matrix's (`fault_args`) under `_attack`."""
    out = tmp_path / "run"
    port = two_free_ports()
    stop, wrote = threading.Event(), []
    attacker = threading.Thread(target=_attack, args=(port, stop, wrote), daemon=True)
    attacker.start()
    launch = Launch(out, *fault_args(*faults, replicas=replicas), "--port", str(port),
                    data=corpus)
    try:
        run = launch.finish(100)
    finally:
        stop.set()
        attacker.join(10)
    assert keys.chain_key(3, 0) in wrote and keys.LIVENESS_ADDR in wrote, wrote
    assert run.returncode == 0, run.stderr[-3000:]
    return run, wrote


def _events(run: Run) -> list[dict]:
    return [json.loads(x) for x in (run.out / rundir.COORDINATOR_LOG).read_text().splitlines()]


def test_forged_store_values_change_nothing(ref4: Run, corpus: Path, tmp_path: Path,
                                           record: Row) -> None:
    """Failure-free: every forgery is read where the run reads that key, and ignored."""
    record.scenario = ("a tokenless store client forges: `commit-plan` decisions with chain "
                       "entries naming step 0's ids for later steps, a `redo`, the next "
                       "generations' members, `gen/count`, the steps' counts and evidence "
                       "counts; rewrites `coord/*` every 50 ms (tests/security, R=2)")
    record.expected = ("each forgery logged and ignored (absent; replaced by its honest writer); "
                       "the coordinator publishes over the forged generations; exit 0")
    run, _ = _attacked_run(tmp_path, corpus, 2)
    record.measured = measure(run)
    check_run(run, ref4, [0, 1])
    # The forgeries were there when the run read them: seen, logged, ignored.
    logs = run.log(0) + run.log(1)
    assert re.search(r"ignored the store's value of step/\d+/g0/decision", logs), logs[-3000:]
    coord = (run.out / rundir.LOGS / rundir.COORDINATOR_OUT).read_text()
    assert "ignored the store's value of gen/1/members" in coord, coord[-3000:]
    assert "coord/liveness: rewritten by someone else; put back" in coord, coord[-3000:]
    gens = [e["gen"] for e in _events(run) if e["event"] == "generation"]
    # The replicas' leaves, published over the forged members of generation 1 (and 2, unless
    # both leaves fall within one debounce and fold into one generation).
    assert gens in ([0, 1], [0, 1, 2]), gens


def test_forged_store_values_during_a_crash_and_a_rejoin(ref4: Run, corpus: Path,
                                                         tmp_path: Path, record: Row) -> None:
    """A replica dies and its replacement joins while the forgeries are there: the survivors
    recover and the replacement starts (reading the liveness address while a stranger rewrites
    `coord/*` every 50 ms; the rest comes in its sealed welcome), on the failure-free
    trajectory."""
    record.scenario = ("the same forgeries during a crash (backward, step 4) and the "
                       "replacement's rejoin (step 7), R=3 (tests/security)")
    record.expected = ("recovered in-step; the replacement waits (< 1 s) for an authentic "
                       "`coord/liveness`, takes the rest from its sealed welcome and joins; no "
                       "forged member in any generation; exit 0")
    run, _ = _attacked_run(tmp_path, corpus, 3, "kill:replica=1,step=4,phase=backward",
                           "restart:replica=1,step=7")
    record.measured = measure(run)
    recs = check_run(run, ref4, [0, 1, 2])
    assert recs[5]["live_replicas"] == 2 and recs[-1]["live_replicas"] == 3, recs
    gens = [e for e in _events(run) if e["event"] == "generation"]
    assert all(7777 not in e["members"] for e in gens), gens
    # Forgeries were read and ignored (which ones a replica happens to read first depends on
    # timing: step 7's stored plan may be written before its forged entry is ever read).
    logs = "".join(run.log(r) for r in range(3))
    assert "ignored the store's value of" in logs, logs[-3000:]
