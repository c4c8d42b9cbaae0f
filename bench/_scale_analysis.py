"""What one scale's rank logs say (bench/scale.py): a failure-free step's store round trips and
control-plane time, and a failure's wall-time parts, main-store requests and survivor CPU.

Invariant: pure functions of the logs (each rank's step records, keyed by (replica, position));
a log that cannot give a figure raises ValueError rather than yield a wrong one.
"""

from __future__ import annotations

from typing import Any

from _common import median

PARTS = ("detect", "agree", "recomp", "rebuild", "reduce", "rest")  # add up to "total"
# Steps after a failure's first commit in the new generation that its requests are counted
# over: its keys are deleted when the commit two steps later is decided, on a background thread
# whose requests land in the step after (recovery/lifetime.py).
TAIL = 3
# The failure-free steps after that window whose rate is subtracted. The deleting rank's
# requests land unevenly (0, 1 or 2 a step, the deletion thread's timing): over 3 steps the rate
# was off by up to 1/3 a step, 0.44 of a request per replica at 4 ranks.
AFTER = 8


def failure_free(steps: dict[Any, list[dict]], lo: int, hi: int) -> dict[str, float]:
    """Store round trips and control-plane time of the steps lo..hi-1 that every rank
    committed at its first attempt in generation 0."""
    by_step: dict[int, list[dict]] = {}
    for recs in steps.values():
        for s in recs:
            if lo <= s["step"] < hi and s["gen"] == 0 and s["attempts"] == 1:
                by_step.setdefault(s["step"], []).append(s)
    full = {t: rs for t, rs in by_step.items() if len(rs) == len(steps)}
    if not full:
        raise ValueError(f"no failure-free step in {lo}..{hi - 1} committed by every rank")
    ops = [max(s["ops"] + s["waits"] for s in rs) for rs in full.values()]
    mean = [sum(s["ops"] + s["waits"] for s in rs) / len(rs) for rs in full.values()]
    eng = [max(s["ops"] for s in rs) for rs in full.values()]
    ctl = [max(s["t_commit"] for s in rs) - max(s["reduces"][-1][2] for s in rs)
           for rs in full.values()]
    commits = sorted(max(s["t_commit"] for s in rs) for rs in full.values())
    cpu = [max(s["control_cpu"] for s in rs) for rs in full.values()]
    # the communicator's own work in a step (gloo's ring; recover's wait for it): its CPU clock
    # at the end of the step's reduce call less at its start, the most any rank spent
    ring = [max(s["reduces"][-1][9] - s["reduces"][-1][8] for s in rs) for rs in full.values()
            if all(len(s["reduces"][-1]) > 9 for s in rs)]
    return {"store_ops": sum(ops) / len(ops), "store_ops_max": max(ops),
            "store_ops_mean": sum(mean) / len(mean),
            "engine_ops": sum(eng) / len(eng), "control_s": median(ctl),
            "control_cpu_s": median(cpu), "reduce_cpu_s": median(ring) if ring else float("nan"),
            "period_s": median([b - a for a, b in zip(commits, commits[1:], strict=False)]),
            "steps": len(full)}


def breakdown(steps: dict[Any, list[dict]], t_kill: float, t_gen: float, g0: int
              ) -> dict[str, float]:
    """Kill -> every survivor (the keys of `steps`) committed in a generation after g0.

    The parts (PARTS) add up to `total` and follow the last survivor to start its reduce in the
    new generation; `teardown` (the part of its agree) is the time its engine spent discarding
    failed reduces (end of reduce_ -> the engine's next hook) after the generation was
    published, and `agree_med` the median survivor's agree."""
    start, rebuild, coll, commit, recomp, teardown, cpu = {}, {}, {}, {}, {}, {}, {}
    agree_cpu: dict[Any, float] = {}
    ops: dict[Any, float] = {}  # store round trips of its step that reduced in the new gen
    raised = 0
    for k, recs in steps.items():
        calls = [c for s in recs for c in s["reduces"]]
        for s in recs:
            call = next((c for c in s["reduces"] if c[0] > g0), None)
            if call is not None and k not in start:
                start[k], commit[k], ops[k] = call[1], s["t_commit"], s["ops"] + s["waits"]
                rebuild[k], coll[k], cpu[k] = call[4] + call[5], call[6], call[7]
                before = [c for c in calls if c[1] < call[1]]
                if before and len(call) > 8:  # its CPU from its last reduce before to this one
                    agree_cpu[k] = call[8] - before[-1][8]
        if k not in start:
            raise ValueError(f"rank {k} has no reduce after generation {g0}")
        failed = [(c, t) for s in recs for c, t in zip(s["reduces"], s["after"], strict=False)
                  if c[3] is not True and c[2] >= t_kill]
        raised += len(failed)
        teardown[k] = sum(max(0.0, min(t, start[k]) - max(c[2], t_gen)) for c, t in failed)
        recomp[k] = sum(max(0.0, min(c1, start[k]) - max(c0, t_gen))
                        for s in recs for c0, c1 in s["computes"])
    last = max(start, key=start.get)
    res = {"detect": t_gen - t_kill, "agree": start[last] - t_gen - recomp[last],
           "recomp": recomp[last], "rebuild": rebuild[last], "reduce": coll[last],
           "total": max(commit.values()) - t_kill, "raised": float(raised),
           "teardown": teardown[last], "rebuild_cpu": cpu[last],
           "agree_cpu": max(agree_cpu.values(), default=float("nan")),
           "agree_med": median([start[k] - t_gen - recomp[k] for k in start]),
           "step_ops": max(ops.values())}
    res["rest"] = res["total"] - sum(res[p] for p in PARTS[:-1])
    return res


def _requests(rec: dict, key: str) -> float:
    """A step record's count `key`; a store's requests include the deletions its rank had
    queued by the commit and not yet sent (`KeyLifetime.pending`): the deletion thread runs
    behind the steps by 0-2 requests, which read at a window's two ends moved up to 2 requests
    a rank into or out of a failure's count."""
    pending = {"main_reqs": "main_pending", "shard_reqs": "shard_pending"}.get(key)
    return rec[key] + (rec.get(pending, 0) if pending else 0)


def failure_requests(steps: dict[Any, list[dict]], t_kill: float, g0: int, coord: float
                     ) -> dict[str, float]:
    """The requests a failure added, per surviving replica (the keys of `steps` are (replica,
    position) of the survivors, each with all its step records, cumulative counts at each
    commit): each survivor's count from the step in flight at the kill through TAIL steps after
    its first commit in a generation after g0, less as many of its steps at the mean rate of
    the AFTER steps that follow (the new membership's failure-free steps: who deletes old keys
    or tops a shard's count may have changed with it); `coord` (the coordinator's own requests
    over the failure) is added to the main store's; `probes`: the data-path probes its ranks
    started (`reach`: a handshake with every member each). `main_kinds`: the survivors' main-store
    requests per key kind (numbers as '#'), per surviving replica."""
    per_replica: dict[int, dict[str, float]] = {}
    kinds: dict[str, float] = {}
    for (rep, pos), recs in steps.items():
        recs = sorted(recs, key=lambda s: s["step"])
        first = next(i for i, s in enumerate(recs) if s["t_commit"] > t_kill)
        end = next(i for i, s in enumerate(recs) if s["gen"] > g0) + TAIL
        if first == 0 or end + AFTER >= len(recs):
            raise ValueError(f"rank {(rep, pos)}: its steps do not cover the failure's window")
        mine = per_replica.setdefault(rep, {"main_reqs": 0.0, "shard_reqs": 0.0, "shard_bytes": 0.0,
                                         "probes": 0.0})
        for key in [k for k in mine if k in recs[end]]:
            at = [_requests(recs[i], key) for i in (first - 1, end, end + AFTER)]
            rate = (at[2] - at[1]) / AFTER
            mine[key] += at[1] - at[0] - (end - first + 1) * rate
        if "main_kinds" in recs[end]:  # the same count, per key kind (storecount.Tally)
            at = [recs[i].get("main_kinds", {}) for i in (first - 1, end, end + AFTER)]
            for kind in set().union(*at):
                a0, a1, a2 = (c.get(kind, 0) for c in at)
                n = a1 - a0 - (end - first + 1) * (a2 - a1) / AFTER
                kinds[kind] = kinds.get(kind, 0.0) + n
    reps = len(per_replica)
    ranks = sum(r["main_reqs"] for r in per_replica.values())
    return {"main_reqs": (ranks + coord) / reps, "rank_main_reqs": ranks / reps,
            "coord_reqs": coord, "main_max": max(r["main_reqs"] for r in per_replica.values()),
            "shard_reqs": sum(r["shard_reqs"] for r in per_replica.values()) / reps,
            "shard_bytes": sum(r["shard_bytes"] for r in per_replica.values()) / reps,
            "probes": sum(r["probes"] for r in per_replica.values()) / reps,
            # the chain's share: what every rank of a multi-rank replica asks (its speaker
            # alone asks the rest, recovery/decide.py)
            "chain_reqs": kinds.get("step/#/chain/#", 0.0) / reps,
            "main_kinds": {k: round(n / reps, 2) for k, n in sorted(kinds.items())
                           if abs(n / reps) >= 0.05}}


def _kill_span(k: Any, recs: list[dict], t_kill: float, g0: int) -> tuple[float, dict]:
    """A survivor's CPU clock at the kill (its last reading before it: every hook, microbatch
    and commit logs one) and its first commit in a generation after g0."""
    marks = [m for s in recs for m in s["marks"]]
    marks += [[s["t_commit"], s["cpu_commit"]] for s in recs]
    before = [m for m in marks if m[0] <= t_kill]
    if not before:
        raise ValueError(f"rank {k} has no CPU reading before the kill")
    return max(before)[1], min((s for s in recs if s["gen"] > g0), key=lambda s: s["step"])


def recovery_cpu(steps: dict[Any, list[dict]], t_kill: float, g0: int) -> float:
    """The most CPU any survivor's process spent from the kill to its first commit in a
    generation after g0. Its CPU clock at the kill is its last reading before it (every hook,
    microbatch and commit logs one): an upper bound, by at most the CPU between readings."""
    most = 0.0
    for k, recs in steps.items():
        at_kill, done = _kill_span(k, recs, t_kill, g0)
        most = max(most, done["cpu_commit"] - at_kill)
    return most


def recovery_cpu_outside(steps: dict[Any, list[dict]], t_kill: float, g0: int) -> float:
    """As `recovery_cpu`, less each survivor's CPU inside the communicator's reduce calls over
    the same span (`open` to the end of `complete`: gloo's connect of the new group and its
    rings, the failed one's abandon): the most any survivor spent on the rest (detection, the
    agreement, the decision, the chain, its recompute, the engine's own bookkeeping)."""
    most = 0.0
    for k, recs in steps.items():
        at_kill, done = _kill_span(k, recs, t_kill, g0)
        calls = [c for s in recs if s["step"] <= done["step"] for c in s["reduces"]]
        if any(len(c) <= 9 for c in calls):
            raise ValueError(f"rank {k}: a reduce record without its CPU clock at the end")
        inside = sum(max(0.0, c[9] - max(c[8], at_kill)) for c in calls)
        most = max(most, done["cpu_commit"] - at_kill - inside)
    return most
