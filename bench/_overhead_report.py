"""Tables of `bench/overhead.py`: recover vs DDP steps interleaved in the same processes.

Input: per replica {"recover": step records from `_profile.Prof`, "ddp": `_ddp.DDPTrainer.rec`
plus "first" (index of each block's first step)}, and the coordinator's CPU clock samples.
"""

from __future__ import annotations

import statistics

from _common import median, say, table


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _recover_samples(reps: list[dict], warmup: int) -> list[dict]:
    """Timed recover steps: after warmup, not the first after a DDP block, not the last step."""
    out = []
    for rep in reps:
        steps = rep["recover"]
        for s in steps[warmup:-1]:
            if not s.get("first") and "loop" in s:
                out.append(s)
    parts = ("compute", "chain", "reduce", "decide", "speed")
    for s in out:
        for pre in ("", "cpu:"):
            s[pre + "other"] = s[pre + "run"] - sum(s.get(pre + k, 0.0) for k in parts)
            s[pre + "trailer"] = s.get(pre + "reduce", 0.0) - s.get(pre + "allreduce", 0.0)
        s["period"] = s["run"] + s["loop"]
        s["cpu:period"] = s["cpu:main"]
        s["rtt:other"], s["store_s:other"] = s.get("rtt:run", 0.0), s.get("store_s:run", 0.0)
        s["rtt:run"] = sum(v for k, v in s.items() if k.startswith("rtt:") and k != "rtt:loop")
        s["store_s:run"] = sum(v for k, v in s.items()
                               if k.startswith("store_s:") and k != "store_s:loop")
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


def _block_pairs(reps: list[dict], warmup: int, block: int) -> list[float]:
    """recover/DDP ratio of each DDP block and the recover block right after it (replica 0)."""
    rec, d = reps[0]["recover"], reps[0]["ddp"]
    ratios = []
    for k, f in enumerate(d["first"]):
        start = (k + 1) * block  # the recover step that follows DDP block k
        if k == 0 or start < warmup:
            continue
        r = [s["run"] + s["loop"] for s in rec[start + 1:start + block] if "loop" in s]
        x = d["step_s"][f + 1:f + block]
        if r and x:
            ratios.append(median(r) / median(x))
    return ratios


def report(reps: list[dict], coord: list[tuple[float, float]], warmup: int, block: int
           ) -> tuple[float, float]:
    """Print the A/B and where recover's time goes; return (wall ratio, CPU ratio)."""
    rs, ds = _recover_samples(reps, warmup), _ddp_samples(reps, block)

    def st(key: str, f=_mean) -> float:
        return f([s.get(key, 0.0) for s in rs])

    def dt(key: str, f=_mean) -> float:
        return f([s[key] for s in ds]) * 1e3

    t_lo, t_hi = rs[0]["t_start"], max(s["t_end"] for s in rs)
    window = [(t, c) for t, c in coord if t_lo <= t <= t_hi]
    rate = ((window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
            if len(window) > 1 else float("nan"))  # cores the coordinator kept busy
    coord_step = rate * st("period", median)
    ratio = st("period", median) / median([s["step_s"] for s in ds])
    cpu_ratio = (st("cpu") + coord_step / len(reps)) / (dt("cpu") / 1e3)
    pairs = _block_pairs(reps, warmup, block)
    say(f"\n  interleaved A/B ({len(rs)} recover and {len(ds)} DDP replica-steps): median step "
        f"recover {st('period', median) * 1e3:.2f} ms, DDP {dt('step_s', median):.2f} ms -> "
        f"ratio {ratio:.3f}")
    if len(pairs) > 1:
        q = statistics.quantiles(pairs, n=4)
        say(f"  per block pair (replica 0, {len(pairs)} pairs): median ratio {median(pairs):.3f}"
            f", quartiles {q[0]:.3f}..{q[2]:.3f}")
    n_mb = reps[0]["ddp"].get("quota")
    bal = [s["max_quota"] for s in rs if "max_quota" in s]
    if bal:
        say(f"  recover's quotas: the busiest replica had {_mean(bal):.2f} microbatches per step "
            f"on average (equal split: {n_mb or '?'}); DDP's split is fixed and equal")
    say(f"  CPU per step (process clocks, all threads): recover {st('cpu') * 1e3:.2f} ms per "
        f"replica + coordinator {coord_step * 1e3:.2f} ms ({rate * 100:.1f}% of a core) shared by "
        f"{len(reps)}; DDP {dt('cpu'):.2f} ms per rank -> CPU ratio {cpu_ratio:.3f}")
    rows = []
    for key, what in (("period", "whole step (run + loop)"), ("run", "engine.run"),
                      ("compute", "  fwd+bwd of own microbatches"),
                      ("chain", "  plan/chain agreement (_sync_chain)"),
                      ("reduce", "  _reduce"),
                      ("allreduce", "    comm.reduce: clone + gloo allreduce + poll"),
                      ("trailer", "    torch.cat trailer copy + verify"),
                      ("decide", "  commit decision (_decide)"),
                      ("speed", "  speed publish (_record_speed)"),
                      ("other", "  rest: out/{me} set, grad assign, hooks"),
                      ("loop", "outside run: lr, clip, AdamW, record")):
        rtt = st(f"rtt:{key}")
        rows.append((what, f"{st(key, median) * 1e3:.2f}", f"{st(key) * 1e3:.2f}",
                     f"{st('cpu:' + key) * 1e3:.2f}", f"{rtt:.1f}" if rtt else "",
                     f"{st('store_s:' + key) * 1e3:.2f}" if rtt else ""))
    rows.append(("background threads (heartbeat, gloo)", "", "",
                 f"{st('cpu:background') * 1e3:.2f}", "", ""))
    say("  recover, per replica-step (main CPU = the training thread's own clock):")
    table(rows, ("phase", "wall med ms", "wall mean ms", "main CPU ms", "store rtt",
                 "store ms"))
    d_main = dt("cpu_accum") + dt("cpu_last") + dt("cpu_opt")
    say(f"  DDP, per rank-step (means): wall {dt('step_s'):.2f} ms = no_sync microbatches "
        f"{dt('accum_s'):.2f} + last microbatch with allreduce {dt('last_s'):.2f} + clip/AdamW "
        f"{dt('opt_s'):.2f}; main-thread CPU {d_main:.2f} ms ({dt('cpu_accum'):.2f} + "
        f"{dt('cpu_last'):.2f} + {dt('cpu_opt'):.2f}), background threads "
        f"{dt('cpu') - d_main:.2f}")
    n_rtt, t_rtt = st("rtt:run") + st("rtt:loop"), st("store_s:run") + st("store_s:loop")
    say(f"  store: {n_rtt:.1f} blocking round-trips per replica-step ({t_rtt * 1e3:.2f} ms "
        f"wall, {t_rtt / max(1.0, n_rtt) * 1e6:.0f} us each), plus 2 per heartbeat (0.1 s) on "
        f"the heartbeat thread; the coordinator reads every heartbeat key every 10 ms")
    return ratio, cpu_ratio
