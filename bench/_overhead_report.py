"""Tables of `bench/overhead.py`: recover vs DDP steps interleaved in the same processes.

Input: per replica {"recover": step records from `_profile.Prof`, "ddp": `_ddp.DDPTrainer.rec`
plus "first" (index of each block's first step), "hooks": which profiler hooks took}, and the
coordinator's CPU clock samples. Invariant: a figure the records do not hold (a counter the
installed library does not expose) is printed as n/a, never as zero.
"""

from __future__ import annotations

import statistics

from _common import median, say, table


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


# Phases of recover's step, from the library's public counters (per-step differences of
# `StepEngine.stats` -> "engine:*" and `FaultTolerantComm.stats` -> "comm:*"; see _profile.py).
# (label, keys summed); "rest" is engine.run minus the engine's three phases.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("  compute: fwd+bwd of own microbatches", ("engine:compute_s",)),
    ("  reduce (StepEngine.stats reduce_s)", ("engine:reduce_s",)),
    ("    comm.reduce (FaultTolerantComm.stats)", ("comm:reduce_s",)),
    ("    group build + store barrier", ("comm:build_s", "comm:barrier_s")),
    ("  commit decision (decide_s)", ("engine:decide_s",)),
)
ENGINE_PHASES = ("engine:compute_s", "engine:reduce_s", "engine:decide_s")


def _recover_samples(reps: list[dict], warmup: int) -> list[dict]:
    """Timed recover steps: after warmup, not the first after a DDP block, not the last step."""
    out = []
    for rep in reps:
        steps = rep["recover"]
        for s in steps[warmup:-1]:
            if not s.get("first") and "loop" in s:
                out.append(s)
    for s in out:
        s["period"] = s["run"] + s["loop"]
        s["cpu:period"] = s["cpu:main"]
        if all(k in s for k in ENGINE_PHASES):
            s["rest"] = s["run"] - sum(s[k] for k in ENGINE_PHASES)
    return out


def _ddp_samples(reps: list[dict], block: int) -> list[dict]:
    """Timed DDP steps: not the first block (warmup), not the first step of a block."""
    out = []
    for rep in reps:
        d = rep["ddp"]
        first = set(d["first"])
        for i in range(block, len(d["end"])):
            if i not in first:
                out.append({k: d[k][i] for k in d if k not in ("first", "cpu", "quota")}
                           | {"cpu": d["cpu"][i] - d["cpu"][i - 1]})
    return out


def _blocks(reps: list[dict], warmup: int, block: int
            ) -> list[tuple[int, str, list[float], list[float]]]:
    """The timed blocks in time order (recover block k, then DDP block k, ...), each as
    (position in that order, kind, every replica's step times, their CPU seconds); a block with
    no timed step is left out (the warmup, DDP's first block, the first step of each block,
    recover's last step)."""
    out = []
    n_blocks = max(len(rep["recover"]) for rep in reps) // block + 1
    for k in range(n_blocks):
        rec = [s for rep in reps for i, s in enumerate(rep["recover"][:-1])
               if k * block <= i < (k + 1) * block and i >= warmup and not s.get("first")
               and "loop" in s]
        out.append((2 * k, "recover", [s["run"] + s["loop"] for s in rec],
                    [s["cpu"] for s in rec]))
        if k == 0:
            continue  # DDP's first block warms it up
        ddp: tuple[list[float], list[float]] = ([], [])
        for rep in reps:
            d = rep["ddp"]
            if k >= len(d["first"]):
                continue
            lo = d["first"][k]
            hi = d["first"][k + 1] if k + 1 < len(d["first"]) else len(d["end"])
            for i in range(lo + 1, hi):  # not the block's first step
                ddp[0].append(d["step_s"][i])
                ddp[1].append(d["cpu"][i] - d["cpu"][i - 1])
        out.append((2 * k + 1, "ddp", *ddp))
    return [b for b in out if b[2]]


def abba_pairs(reps: list[dict], warmup: int, block: int, coord_share: float
               ) -> tuple[list[float], list[float]]:
    """recover/DDP ratios (wall, CPU) of each two adjacent blocks of different kinds: recover
    then DDP, DDP then recover, ... (AB, BA, AB: each block in two pairs), so a drift of the
    machine's speed raises as many ratios as it lowers. A block's figure is the median over its
    steps on every replica; recover's CPU includes `coord_share` (the coordinator's per step)."""
    blocks = _blocks(reps, warmup, block)
    wall, cpu = [], []
    for (p1, k1, w1, c1), (p2, _, w2, c2) in zip(blocks, blocks[1:], strict=False):
        if p2 != p1 + 1:
            continue  # a block left out between them: not adjacent
        (rw, rc), (dw, dc) = ((w1, c1), (w2, c2)) if k1 == "recover" else ((w2, c2), (w1, c1))
        wall.append(median(rw) / median(dw))
        cpu.append((median(rc) + coord_share) / median(dc))
    return wall, cpu


def _coord_rate(coord: list[tuple[float, float]], t_lo: float, t_hi: float) -> float:
    """Cores the coordinator kept busy over the timed window, from its (time, CPU seconds)
    samples (every 0.2 s) inside it; where fewer than two fall inside (a short run, as the
    smoke's: its CPU ratios came out NaN in 1 to 2 runs of 3), from the nearest ones around it."""
    inside = [(t, c) for t, c in coord if t_lo <= t <= t_hi]
    if len(inside) < 2:
        inside = ([x for x in coord if x[0] < t_lo][-1:] + inside
                  + [x for x in coord if x[0] > t_hi][:1])
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return float("nan")  # the coordinator was not sampled twice: no figure
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def report(reps: list[dict], coord: list[tuple[float, float]], warmup: int, block: int
           ) -> tuple[list[float], list[float]]:
    """Print the A/B and where recover's time goes; return the recover/DDP ratios (wall, CPU)
    of the pairs of adjacent blocks (`abba_pairs`), or the pooled ratios where no pair is."""
    rs, ds = _recover_samples(reps, warmup), _ddp_samples(reps, block)

    def st(key: str, f=_mean) -> float:
        return f([s.get(key, 0.0) for s in rs])

    def dt(key: str, f=_mean) -> float:
        return f([s[key] for s in ds]) * 1e3

    rate = _coord_rate(coord, rs[0]["t_start"], max(s["t_end"] for s in rs))
    coord_step = rate * st("period", median)
    ratio = st("period", median) / median([s["step_s"] for s in ds])
    cpu_ratio = (st("cpu") + coord_step / len(reps)) / (dt("cpu") / 1e3)
    pairs, cpu_pairs = abba_pairs(reps, warmup, block, coord_step / len(reps))
    say(f"\n  interleaved A/B ({len(rs)} recover and {len(ds)} DDP replica-steps): median step "
        f"recover {st('period', median) * 1e3:.2f} ms, DDP {dt('step_s', median):.2f} ms -> "
        f"pooled ratio {ratio:.3f}")
    if len(pairs) > 1:
        q = statistics.quantiles(pairs, n=4)
        say(f"  per pair of adjacent blocks ({len(pairs)} pairs, AB BA AB ..., every replica's "
            f"steps): median ratio {median(pairs):.3f}, quartiles {q[0]:.3f}..{q[2]:.3f}, range "
            f"{min(pairs):.3f}..{max(pairs):.3f}; CPU median {median(cpu_pairs):.3f}")
    n_mb = reps[0]["ddp"].get("quota")
    bal = [s["max_quota"] for s in rs if "max_quota" in s]
    if bal:
        say(f"  recover's quotas: the busiest replica had {_mean(bal):.2f} microbatches per step "
            f"on average (equal split: {n_mb or '?'}); DDP's split is fixed and equal")
    say(f"  CPU per step (process clocks, all threads): recover {st('cpu') * 1e3:.2f} ms per "
        f"replica + coordinator {coord_step * 1e3:.2f} ms ({rate * 100:.1f}% of a core) shared by "
        f"{len(reps)}; DDP {dt('cpu'):.2f} ms per rank -> CPU ratio {cpu_ratio:.3f}")
    have = {k for s in rs for k in s}

    def ms(keys: tuple[str, ...]) -> tuple[str, str]:
        if not all(k in have for k in keys):
            return "n/a", "n/a"  # a counter this version of the library does not expose
        vals = [sum(s.get(k, 0.0) for k in keys) for s in rs]
        return f"{median(vals) * 1e3:.2f}", f"{_mean(vals) * 1e3:.2f}"

    def store(where: str) -> tuple[str, str]:
        if not all(r.get("hooks", {}).get("store") for r in reps):
            return "n/a", "n/a"
        return f"{st('rtt:' + where):.1f}", f"{st('store_s:' + where) * 1e3:.2f}"

    rows = [("whole step (run + loop)", *ms(("period",)), f"{st('cpu:period') * 1e3:.2f}", "",
             ""),
            ("engine.run", *ms(("run",)), f"{st('cpu:run') * 1e3:.2f}", *store("run"))]
    rows += [(what, *ms(keys), "", "", "") for what, keys in PHASES]
    rows += [("  rest: plan/chain agreement, speeds, bookkeeping", *ms(("rest",)), "", "", ""),
             ("outside run: lr, clip, AdamW, record", *ms(("loop",)),
              f"{st('cpu:loop') * 1e3:.2f}", *store("loop")),
             ("background threads (heartbeat, gloo)", "", "",
              f"{st('cpu:background') * 1e3:.2f}", "", "")]
    say("  recover, per replica-step (main CPU = the training thread's own clock; n/a = a "
        "counter the installed library does not expose):")
    table(rows, ("phase", "wall med ms", "wall mean ms", "main CPU ms", "store rtt",
                 "store ms"))
    d_main = dt("cpu_accum") + dt("cpu_last") + dt("cpu_opt")
    say(f"  DDP, per rank-step (means): wall {dt('step_s'):.2f} ms = no_sync microbatches "
        f"{dt('accum_s'):.2f} + last microbatch with allreduce {dt('last_s'):.2f} + clip/AdamW "
        f"{dt('opt_s'):.2f}; main-thread CPU {d_main:.2f} ms ({dt('cpu_accum'):.2f} + "
        f"{dt('cpu_last'):.2f} + {dt('cpu_opt'):.2f}), background threads "
        f"{dt('cpu') - d_main:.2f}")
    if all(r.get("hooks", {}).get("store") for r in reps):
        n_rtt = st("rtt:run") + st("rtt:loop")
        t_rtt = st("store_s:run") + st("store_s:loop")
        own = (f"; StepEngine.stats counts {st('engine:store_ops'):.1f} of them in the engine"
               if "engine:store_ops" in have else "")
        say(f"  store: {n_rtt:.1f} blocking round-trips per replica-step on the training thread "
            f"({t_rtt * 1e3:.2f} ms wall, {t_rtt / max(1.0, n_rtt) * 1e6:.0f} us each){own}; "
            f"heartbeats and the coordinator's reads come on top")
    else:
        say("  store: round-trips not counted (the store hook did not take; see the logs)")
    if not pairs:
        say("  no two adjacent timed blocks: the ratios below pool every timed step")
        return [ratio], [cpu_ratio]
    return pairs, cpu_pairs
