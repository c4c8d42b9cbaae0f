"""Layer 3 properties: every id of a step is covered exactly once, for any membership and speeds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.workload import id_checksum, id_seed, plan, quotas, reassign, step_ids

members_st = st.sets(st.integers(0, 63), min_size=1, max_size=16).map(sorted)
speeds_st = st.dictionaries(st.integers(0, 63), st.floats(0.001, 10.0), max_size=16)


@settings(max_examples=300, deadline=None)
@given(step=st.integers(0, 10_000), n=st.integers(1, 256), members=members_st, speeds=speeds_st)
def test_plan_covers_each_id_once(step: int, n: int, members: list[int],
                                  speeds: dict[int, float]) -> None:
    p = plan(step, n, members, speeds)
    ids = sorted(i for v in p.values() for i in v)
    assert ids == step_ids(step, n)
    assert set(p) == set(members)
    if n >= len(members):
        assert all(len(v) >= 1 for v in p.values())
    assert plan(step, n, members, speeds) == p  # deterministic


@settings(max_examples=300, deadline=None)
@given(lost=st.sets(st.integers(0, 10_000), max_size=64).map(sorted), survivors=members_st,
       speeds=speeds_st)
def test_reassign_covers_each_lost_id_once(lost: list[int], survivors: list[int],
                                           speeds: dict[int, float]) -> None:
    r = reassign(lost, survivors, speeds)
    assert sorted(i for v in r.values() for i in v) == lost
    assert set(r) <= set(survivors)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 512), members=members_st, speeds=speeds_st)
def test_quotas_sum_to_n(n: int, members: list[int], speeds: dict[int, float]) -> None:
    q = quotas(n, members, speeds)
    assert sum(q.values()) == n and all(v >= 0 for v in q.values())


def test_straggler_gets_about_half() -> None:
    q = quotas(24, [0, 1, 2, 3], {0: 0.1, 1: 0.2, 2: 0.1, 3: 0.1})
    assert q[1] in (3, 4)  # 24 * 0.5 / 3.5 = 3.4
    assert q[0] == q[2] == q[3] and q[0] > q[1]


def test_noise_does_not_change_quotas() -> None:
    assert quotas(16, [0, 1, 2, 3], {0: 0.100, 1: 0.108, 2: 0.095, 3: 0.104}) == \
        {0: 4, 1: 4, 2: 4, 3: 4}


def test_uneven_split_is_the_documented_one() -> None:
    assert quotas(10, [0, 1, 2, 3]) == {0: 3, 1: 3, 2: 2, 3: 2}


def test_id_seed_is_pure_and_separates_streams() -> None:
    assert id_seed(1, 5) == id_seed(1, 5)
    assert len({id_seed(1, i) for i in range(1000)}) == 1000
    assert id_seed(1, 5, stream=0) != id_seed(1, 5, stream=1) != id_seed(2, 5)


def test_checksum_is_exact_in_float64_up_to_2_to_the_20_ids() -> None:
    import torch

    ids = step_ids(10_000, 1 << 20)  # the engine's limit (recover.recovery.step.MAX_MICROBATCHES)
    c = id_checksum(ids)
    assert c < 2**53 and int(torch.tensor(float(c), dtype=torch.float64)) == c
    assert id_checksum(ids[:-1]) != c
    assert id_checksum(step_ids(3, 8)) != id_checksum([*step_ids(3, 7), 3 * 8 + 9])


def test_plan_rejects_empty_membership() -> None:
    with pytest.raises(ValueError):
        plan(0, 8, [])
