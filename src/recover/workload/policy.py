"""The versatile-workload policy: who computes which microbatch ids.

Invariant: for any step and any non-empty member set, `plan` assigns every id of the step to
exactly one member (quotas sum to N), and `reassign` assigns every lost id to exactly one survivor.
Both are pure, deterministic functions of their arguments, so every replica that evaluates them
gets the same answer. Quotas follow measured speed (a replica twice as slow gets about half), but
the *data* of a step never depends on them: only how the N microbatches are grouped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from recover.workload.ids import step_ids

# Relative speeds are rounded to this, so timing noise on a shared CPU (docs/MEASUREMENTS.md,
# "Threads and start-up") does not churn plans; a real straggler (2x slower: 0.5) still stands out.
SPEED_RESOLUTION = 0.25


def _weights(members: Sequence[int], speeds: Mapping[int, float] | None) -> list[float]:
    """Relative throughput per member from seconds-per-microbatch (unknown = the median)."""
    if not speeds:
        return [1.0] * len(members)
    present = set(members)  # a set: this runs for every plan, with R members
    known = sorted(t for m, t in speeds.items() if m in present and t > 0)
    if not known:
        return [1.0] * len(members)
    median = known[len(known) // 2]
    times = [speeds.get(m, median) if speeds.get(m, 0) > 0 else median for m in members]
    fastest = min(times)
    return [max(SPEED_RESOLUTION, round(fastest / t / SPEED_RESOLUTION) * SPEED_RESOLUTION)
            for t in times]


def quotas(n: int, members: Sequence[int], speeds: Mapping[int, float] | None = None,
           min_each: int = 0) -> dict[int, int]:
    """Split `n` microbatches over `members` in proportion to speed (largest remainder)."""
    members = sorted(members)
    if not members:
        raise ValueError("no members to assign microbatches to")
    if n < 0 or min_each * len(members) > n:
        raise ValueError(f"cannot give {len(members)} members {min_each} of {n} microbatches each")
    w = _weights(members, speeds)
    total = sum(w)
    exact = [n * x / total for x in w]
    q = [int(e) for e in exact]
    # Largest remainder; ties go to the lower member id, deterministically.
    order = sorted(range(len(members)), key=lambda i: (-(exact[i] - q[i]), members[i]))
    for i in order[: n - sum(q)]:
        q[i] += 1
    # Keep every member measured (a member with no work has no speed): take from the largest.
    for i in range(len(q)):
        while q[i] < min_each:
            j = max(range(len(q)), key=lambda k: (q[k], -members[k]))
            q[j] -= 1
            q[i] += 1
    return dict(zip(members, q, strict=True))


def _split(ids: Sequence[int], quota: Mapping[int, int]) -> dict[int, list[int]]:
    out, pos = {}, 0
    for m in sorted(quota):
        out[m] = list(ids[pos: pos + quota[m]])
        pos += quota[m]
    assert pos == len(ids)
    return out


def plan(step: int, n: int, members: Sequence[int],
         speeds: Mapping[int, float] | None = None) -> dict[int, list[int]]:
    """Assign the N ids of `step` to `members`: contiguous runs, at least one each when N >= R."""
    min_each = 1 if n >= len(members) else 0
    return _split(step_ids(step, n), quotas(n, members, speeds, min_each))


def reassign(lost_ids: Sequence[int], survivors: Sequence[int],
             speeds: Mapping[int, float] | None = None) -> dict[int, list[int]]:
    """Spread the ids of lost replicas over the survivors, in proportion to speed."""
    return _split(sorted(lost_ids), quotas(len(lost_ids), survivors, speeds))
