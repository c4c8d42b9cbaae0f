"""Layers 1-2 in one process: the step protocol's edge cases, each in about a second.

A real coordinator and real members (own store clients, liveness sockets, gloo groups) run as
threads (tests/_inproc.py); faults are scripted at exact protocol points. Every test checks that
every gradient any rank returned is the exact sum of the step's N integer-valued per-id gradients,
that quotas sum to N, and that each step committed in exactly one generation, the one every rank
reports. Each runs with one store and again with 3 store shards (control/shards.py), where
a shard's decision must be a copy of the main store's. Real processes and real SIGKILLs:
tests/test_recovery.py, test_collectives.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.inproc import Fault, Harness
from recover.control import keys

pytestmark = pytest.mark.timeout(120)
N = 8


@pytest.fixture(params=[0, 3], ids=["one-store", "shards"], autouse=True)
def store_shards(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(Harness, "default_shards", request.param)
    return int(request.param)


def test_failure_free(tmp_path: Path) -> None:
    h = Harness(tmp_path, 4, steps=3).run()
    res = h.check([0, 1, 2, 3])
    assert all(r.generation == 0 and r.attempts == 1 and r.quotas == {0: 2, 1: 2, 2: 2, 3: 2}
               for r in res.values()), res


def test_prefetch_names_the_ids_the_next_step_computes(tmp_path: Path, store_shards: int) -> None:
    """While a verified rank waits for the decision, `prefetch` gets the next step's ids; in a
    failure-free run (the plan implied by each commit) they are the ids it then computes."""
    h = Harness(tmp_path, 3, steps=5).run()
    h.check([0, 1, 2])
    named = 0
    for rank in h.ranks.values():
        for t, ids in rank.prefetched.items():
            assert 1 <= t <= h.steps, t
            if t < h.steps:
                assert ids == rank.computed[t], (rank.replica, t, ids, rank.computed)
                named += 1
    # Every rank that waits names the next step: all but the one whose count decides (one
    # store), or every rank (shards: the coordinator decides).
    assert named >= (h.steps - 1) * (2 if store_shards == 0 else 3), named


@pytest.mark.parametrize("phase", ["compute", "reduce", "commit", "outcome", "optimizer"])
def test_kill_in_each_phase(tmp_path: Path, phase: str) -> None:
    h = Harness(tmp_path, 4, steps=3, faults=[Fault(2, 1, phase, j=1)]).run()
    res = h.check([0, 1, 3])
    assert res[2].members == [0, 1, 3] and res[2].quotas.get(2) is None
    if phase == "compute":  # replica 2 died before its second id: both of its ids were redone
        chain = h.chain(1)
        assert [e["gen"] for e in chain] == [0, 1]
        assert res[1].recovered == chain[0]["assign"]["2"] and res[1].generation == 1, res[1]
    if phase == "optimizer":  # it died after step 1 committed everywhere, in generation 0
        assert res[1].generation == 0 and res[1].quotas[2] == 2 and res[1].attempts == 1


def test_split_outcome_redo_everywhere(tmp_path: Path) -> None:
    """Replica 1's reduce completed, then raised (as a dead peer's neighbour's does); the others
    hold the full sum. Nobody may apply it alone: all redo, in a rebuilt generation."""
    h = Harness(tmp_path, 4, steps=3, faults=[Fault(1, 1, "reduce", action="raise")]).run()
    res = h.check([0, 1, 2, 3])
    assert res[1].generation == 1 and res[1].attempts == 2 and res[1].members == [0, 1, 2, 3]
    assert h.generations()[1] == [0, 1, 2, 3]
    assert h.decision(1, 0) == b"redo"


def test_split_outcome_then_death(tmp_path: Path) -> None:
    """The replica that raised dies right after writing its `fail`: survivors that still count
    it propose redo, those that see it gone may propose commit (its part is in their sums);
    the first proposal decides for everyone."""
    h = Harness(tmp_path, 4, steps=3, faults=[Fault(1, 1, "reduce", action="raise"),
                                             Fault(1, 1, "outcome")]).run()
    h.check([0, 2, 3])
    assert h.decision(1, 0) in (b"redo", b"commit", b"commit-plan")


def test_second_loss_during_recovery(tmp_path: Path) -> None:
    # Replica 1 dies on its first id; replica 2 dies on its first recomputed one (its j = 2).
    h = Harness(tmp_path, 4, steps=3, faults=[Fault(1, 1, "compute", j=0),
                                             Fault(2, 1, "compute", j=2)]).run()
    res = h.check([0, 3])
    chain = h.chain(1)
    gens = [e["gen"] for e in chain]
    assert len(chain) >= 3 and gens == sorted(set(gens)), chain  # extended twice
    assert res[1].attempts >= 2 and res[1].members == [0, 3]


def test_two_losses_at_once(tmp_path: Path) -> None:
    h = Harness(tmp_path, 4, steps=3, faults=[Fault(1, 1, "compute", j=1),
                                             Fault(3, 1, "compute", j=1)]).run()
    res = h.check([0, 2])
    plan = h.chain(1)[0]["assign"]
    assert res[1].recovered == sorted(plan["1"] + plan["3"]), res[1]


def test_down_to_one_survivor(tmp_path: Path) -> None:
    h = Harness(tmp_path, 3, steps=4, faults=[Fault(1, 1, "compute", j=0),
                                             Fault(2, 2, "reduce")]).run()
    res = h.check([0])
    assert res[3].quotas == {0: N} and res[3].members == [0]


def test_simultaneous_proposals_decide_once(tmp_path: Path) -> None:
    """All ranks write their outcome and race to decide at the same moment, step after step."""
    h = Harness(tmp_path, 4, steps=8, barrier_at_commit=True).run()
    res = h.check([0, 1, 2, 3])
    assert all(h.decision(t, 0) in (b"commit", b"commit-plan") for t in res)


def test_hang_is_fenced(tmp_path: Path) -> None:
    h = Harness(tmp_path, 3, steps=3, stale_s=1.0,
                faults=[Fault(1, 1, "compute", j=0, action="hang")]).run()
    h.check([0, 2])
    assert "fenced" in (h.ranks[(1, 0)].fenced or "")
    assert any("replica 1: silent for" in e["reason"] for e in h.events("generation"))


@pytest.mark.parametrize("speaker", [False, True])
def test_multi_position_skip_and_kill(tmp_path: Path, speaker: bool) -> None:
    """positions=2 (two ranks per replica): rank 1 of replica 2 dies; rank 1 of replica 0 is late
    and moves past generation 0 without reducing in it, so it must decide `redo` there at once
    (its sibling at position 0 may hold a verified sum of generation 0 and wait for a decision).
    With a speaker (recovery/decide.py), the late rank's agreement with its speaker fails, and
    the speaker writes `redo`."""
    h = Harness(tmp_path, 3, positions=2, n=6, steps=3, speaker=speaker,
                faults=[Fault(2, 1, "compute", j=0, rank=1),
                        Fault(0, 1, "compute", j=1, rank=1, action="hold")]).run()
    res = h.check([0, 1])
    assert h.ranks[(2, 0)].fenced, "the dead rank's sibling must be fenced"
    assert h.decision(1, 0) == b"redo"
    assert res[1].members == [0, 1] and res[1].generation >= 1


@pytest.mark.parametrize("speaker", [False, True])
def test_a_decision_on_evidence_costs_each_rank_o1_round_trips(tmp_path: Path,
                                                               speaker: bool) -> None:
    """Replica 2's rank 0 dies after its reduce (position 0's sum holds its part) and its sibling's
    (a plain kill there could beat the sibling's reduce on a loaded machine: a CI run), before it
    counted: the others' count cannot complete, the membership changes, and the survivors
    decide on evidence. Each counts itself once for the new generation; reading every rank's
    outcome instead cost each O(R x P) round trips (121 at 16 x 8 in bench/scale.py). With a
    speaker per replica its position 0 counts for both, its sibling asks nothing.

    The decision names the generation counted (`commit@{s}`), so step 2's plan is implied for
    s's members as after any commit: nothing of step 2's chain is stored, and step 2 costs
    each survivor what a failure-free step does (2 round trips; with a speaker its sibling,
    told the decision through the link, learns s and asks nothing)."""
    h = Harness(tmp_path, 8, positions=2, n=16, steps=3, speaker=speaker,
                faults=[Fault(2, 1, "commit", rank=0, action="kill-reduced")]).run()
    res = h.check([0, 1, 3, 4, 5, 6, 7])
    decided = h.decision(1, 0)
    assert res[1].generation == 0 and decided is not None, res[1]
    seen = keys.implied_generation(decided, 0)
    assert decided.startswith(keys.COMMIT_AT) and seen is not None and seen >= 1, decided
    assert 2 not in keys.decode_members(h.read(keys.members_key(seen)) or b"[2]"), seen
    assert h.read(keys.chain_key(2, 0)) is None and h.chain(2)[0]["gen"] == seen, h.chain(2)
    survivors = [r for r in h.ranks.values() if r.replica != 2]
    per_rank = [r.ops[1] for r in survivors]
    assert max(per_rank) <= 6, per_rank  # count, decision wait, evidence, its wait, decide
    after = [r.ops[2] for r in survivors if not speaker or r.rank == 0]
    assert max(after) <= 2, after  # step 2: count and decision wait, its plan implied
    if speaker:
        assert all(r.ops[t] == 0 for r in survivors if r.rank == 1 for t in (1, 2)), per_rank


@pytest.mark.parametrize("speaker", [False, True])
def test_a_failures_chain_entry_costs_a_replica_one_request_with_a_speaker(tmp_path: Path,
                                                                          speaker: bool) -> None:
    """Replica 2's rank 0 dies in step 1's compute: the survivors extend step 1's chain (entry 1
    hands replica 2's ids over). Without a speaker every rank writes or reads that entry; with
    one only position 0 does and hands it to its sibling through the replica's link
    (recovery/chain.py), so the sibling asks the store nothing in step 1, as in a failure-free
    step."""
    h = Harness(tmp_path, 3, positions=2, n=6, steps=3, speaker=speaker,
                faults=[Fault(2, 1, "compute", j=0, rank=0)]).run()
    res = h.check([0, 1])
    assert len(h.chain(1)) >= 2 and res[1].members == [0, 1], h.chain(1)
    siblings = [r.ops[1] for r in h.ranks.values() if r.replica != 2 and r.rank == 1]
    speakers = [r.ops[1] for r in h.ranks.values() if r.replica != 2 and r.rank == 0]
    assert all(n >= 1 for n in speakers), speakers  # the chain's extension at least
    if speaker:
        assert siblings == [0, 0], siblings
    else:
        assert all(n >= 1 for n in siblings), siblings


def test_a_rank_whose_reduce_failed_never_applies_a_commit(tmp_path: Path) -> None:
    """Replica 1's reduce raises; then `commit` is forged into the step's decision key before it
    decides. The protocol never decides so; the rank refuses loudly (CommitRefused) instead of
    applying a sum it holds no verified copy of, and step 1 is not in its results."""
    h = Harness(tmp_path, 2, steps=2, faults=[Fault(1, 1, "reduce", action="raise"),
                                             Fault(1, 1, "commit", action="forge")])
    with pytest.raises(AssertionError, match="CommitRefused"):
        h.run()
    assert sorted(h.ranks[(1, 0)].results) == [0]
    assert sorted(h.ranks[(0, 0)].results) == [0, 1]


@pytest.mark.parametrize(("phase", "rank", "action"), [
    ("compute", 0, "kill"), ("reduce", 0, "kill"), ("commit", 0, "kill"),
    ("outcome", 0, "kill"), ("reduce", 1, "kill"), ("commit", 1, "kill-reduced"),
    ("reduce", 1, "raise"), ("compute", 0, "hang")])
def test_a_speaker_or_its_sibling_lost_in_any_phase(tmp_path: Path, phase: str, rank: int,
                                                    action: str) -> None:
    """Speakers per replica (positions=2): replica 1's speaker (rank 0) or its sibling dies,
    hangs or fails its reduce at each point of step 1. The survivors commit every step with
    all N microbatches and the oracle's sum (`check`); replica 1's ranks are fenced unless
    only its reduce failed (then it redoes the step with the others)."""
    h = Harness(tmp_path, 3, positions=2, n=6, steps=3, speaker=True, stale_s=1.0,
                faults=[Fault(1, 1, phase, rank=rank, action=action)]).run()
    survivors = [0, 1, 2] if action == "raise" else [0, 2]
    res = h.check(survivors)
    assert all(r.microbatches == 6 for r in res.values())
    if action != "raise":
        live = [r for r in h.ranks.values() if r.replica == 1 and not r.dead.is_set()]
        assert not live, [r.name for r in live]
