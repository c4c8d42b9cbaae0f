"""Control-plane cost as the job grows: 4 to 128 ranks of the step protocol on one machine.

What: per scale (R replicas x P ranks each), a real coordinator and R*P rank processes, all forked
by the standard library's fork server after one `import torch` (`harness.scale`), run the
step protocol (`StepEngine.run`) on a --numel float tensor: each step's N = R microbatches add a
known integer-valued gradient (checked exactly after every commit). P > 1 runs multi-position
engines (a `Member` of P ranks each, one `FaultTolerantComm` per position), a replica's ranks in
their own gloo group whose rank 0 speaks for them to the store (`IntraReplicaLink`;
`--no-speaker`: every rank asks). Measured, per scale:

  store ops      store round trips per rank per failure-free step: `engine.stats["store_ops"]`
                 deltas plus the engine's blocking key waits (`engine.store_waits`, one round
                 trip each, on a helper thread that `store_ops` does not count); mean over steps of
                 the max over ranks.
  control        failure-free: the last rank's reduce returns -> the commit is known on every
                 rank (max over ranks of each; time.time(), one clock); median over steps;
                 `control_cpu`: the most any rank's process spent of its CPU (every thread)
                 from its reduce's end to its commit, median over steps: the control plane's
                 own work, without the wait for a core (R*P processes share this machine's).
  kill           SIGKILL of one rank (so one replica) at a random moment of a step -> every
                 survivor committed a step in the new generation, split into
     detect      kill -> the coordinator publishes the new generation (`coordinator.jsonl`);
     agree       -> the last survivor starts its reduce in it, less its recompute of lost
                 microbatches in between (shown as `recomp`); of which `teardown`: the time
                 its engine spent discarding failed reduces (end of `reduce_` -> the engine's
                 next hook: destroying a gloo group a dead peer left mid-operation);
                 `agree_med` is the median survivor's agree; `agree_cpu` the most any
                 survivor's process spent of its CPU (every thread) from the start of its
                 last reduce before the new generation's to the start of that one: its own
                 work in the failure and the agreement, without the wait for a core;
     rebuild     that survivor's new communicator: `comm.stats` barrier_s + build_s deltas;
                 `rebuild_cpu` is its process's CPU time over the same span (`build_cpu_s`,
                 every thread): its own work, without the wait for a share of the cores (R*P
                 processes on this machine's cores inflate the wall time, not this);
     reduce      its redone collective (`comm.stats` reduce_s delta);
     rest        -> the last survivor's commit (decision, stragglers).
     store_cpu   the coordinator's CPU time (it runs the store server) from the kill to the
                 survivors' --settle commits, less what as many failure-free steps cost it:
                 the server's work for detection, agreement and the group's rendezvous;
     rec_out     the same, less the CPU inside the survivor's reduce calls over the span (`open`
                 to the end of `complete`: gloo's connect of the new group, its collectives,
                 and the failed op's abandon): the protocol's own work (detection, agreement,
                 decision, chain, recompute), the most any survivor spent; beside it, a
                 failure-free step's reduce call's CPU (the collective alone: the tree of
                 `collectives.tree` up to its TREE_MAX_BYTES, gloo's ring past) at each size;
     rec_ops     the store round trips of a survivor's step that reduced in the new
                 generation (the most any survivor made), less a failure-free step's: what a
                 failure adds per rank (the engine's own calls);
     rec_cpu     the most CPU (every thread) any survivor's process spent from the kill to its
                 first commit in the new generation; its CPU clock at the kill is read off its
                 last reading before it (one at every engine hook and microbatch: an upper
                 bound, by at most the CPU between two readings);
     main_req    every request the main store served because of the failure, per replica:
                 each survivor's requests on every main-store client it opened (counted on the
                 client side, `recover.control.storecount`: redo, chain, evidence counts,
                 decisions, generation reads, key deletions and, without shards, the
                 rendezvous; at each commit, with the deletions it had queued and not yet
                 sent, `KeyLifetime.pending`: its deletion thread runs behind by 0-2 requests)
                 from the step in flight at the kill to TAIL steps after its first
                 commit in the new generation (the failure's keys are deleted two commits
                 later), less as many steps at its rate over the AFTER steps that follow (the
                 2 s generation fallback reads in the recovery's extra wall time stay in),
                 plus the coordinator's (the generation's publication), over the surviving
                 replicas (and its decisions' compare-and-set, one a step, subtracted at
                 the failure-free rate like the ranks'); `main_max` is the
                 most any one replica added; `shard_req` the same count on the store shards
                 (with shards: the rendezvous, barrier and gloo's address exchange, batched:
                 `collectives/meshstore.py`); `shard_kB` the value bytes the shards sent
                 each survivor over the same span (gloo's addresses: O(R) values of O(R)
                 bytes).

Store shards: every mode runs with --store-shards 2 by default, as a large job would (about one
per 1,000 ranks): the main store then serves the counts' tree top and a failure's agreement, the
shards the counts and every rendezvous; `--store-shards 0` measures one store doing it all.

A survivor that dies, a wrong gradient or a stuck step (every live rank's stacks are then dumped
into its .err log) is a protocol failure: reported, never hidden, and the scale is retried
(--retries). Every process is ended by PID in a `finally` (`recover.procs`). Outputs in --out:
`scale.json` (the P = 1 curve: {"source", "ranks", "group", "store_ops_per_rank_step",
"control_plane_s", "control_plane_cpu_s", "detect_s", "agree_s", "rebuild_s", "rebuild_cpu_s",
"reduce_s", "store_cpu_s", "recovery_store_ops_per_rank", "failure_main_requests_per_rank",
"failure_main_chain_requests_per_rank", "failure_coordinator_requests",
"failure_shard_requests_per_member", "failure_shard_bytes_per_member", "store_shards",
"store_request_cpu_s", "store_byte_cpu_s"}, the last two the store server's CPU per request and
per value byte sent, `_store_rate.py`; "group" is
the size of the cross-replica group rebuilt, R, here = ranks), `scale_detail.json` (every
scale and kill, and the failures), `scale.png`, and each scale's logs; `--write-curve` also
copies `scale.json` to `src/recover/app/sim/data/scale_curve.json` (the simulator's input). Last
lines:
`store_ops_per_rank_step=<max over scales>`, `recovery_cpu_ratio=<rec_cpu at the largest P = 1
scale / at the smallest>` and `main_store_requests_per_failure_per_replica=<max over scales of
main_req>` (goals: <= 2, <= 1.5, <= 4), after `recovery_cpu_outside_collective_ratio=` (rec_out's
ratio), `failure_free_reduce_cpu_ratio=` (a failure-free reduce call's CPU, the same sizes:
what the collective alone grows by, measured in the same run) and `same_work_cpu_ratio=` (one
fixed pass of work's CPU in a process among as many busy processes as the largest size has
ranks, over the smallest's, `_same_work.py`: what the machine's shared cores add to any CPU
ratio here, measured after the scales).

    python bench/scale.py --smoke          # 2, 4 ranks and 3 x 2 (a speaker), 3 steps, a small
                                           # store-rate run (CI)
    python bench/scale.py --quick          # 4, 16, 64 ranks; < 3 min
    python bench/scale.py --write-curve    # 4, 16, 64, 128 ranks, and 8 x 8, 16 x 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import (
    BENCH_DIR,
    bench_args,
    cores,
    cpu_seconds,
    defaults,
    fresh_dir,
    loadavg,
    median,
    out_dir,
    say,
    table,
)
from _same_work import pass_cpu_s
from _scale_analysis import (
    AFTER,
    PARTS,
    TAIL,
    breakdown,
    failure_free,
    failure_requests,
    recovery_cpu,
    recovery_cpu_outside,
)
from _store_rate import byte_cpu_s, request_cpu_s
from harness.scale import (
    Children,
    CoordArgs,
    RankArgs,
    Tail,
    coordinator_main,
    dump_stacks,
    pss_mib,
    rank_main,
    wait_for,
)
from recover.collectives.tree import TREE_MAX_BYTES

log = logging.getLogger("bench.scale")
CURVE = BENCH_DIR.parent / "src" / "recover" / "sim" / "data" / "scale_curve.json"
EXTRA = (*PARTS, "total", "teardown", "agree_med", "agree_cpu", "rebuild_cpu", "store_cpu",
         "recovery_ops", "recovery_cpu", "recovery_cpu_outside", "main_reqs", "main_max",
         "shard_reqs", "rank_main_reqs", "coord_reqs", "probes", "shard_bytes", "chain_reqs")


class FalseAlarm(RuntimeError):
    """The membership changed without a kill (a live rank was declared lost)."""


class ProtocolFailure(RuntimeError):
    """A survivor died or committed a wrong gradient: a failure of the library, not of the
    bench (its logs, with every live rank's stacks, stay in the scale's folder)."""


# -- one scale ------------------------------------------------------------------------------
def generations(path: Path) -> list[dict]:
    return [e for e in Tail(path).read() if e.get("event") == "generation"]


def run_scale(reps: int, pos: int, a: argparse.Namespace, rng: random.Random, d: Path) -> dict:
    fresh_dir(d)  # a reused folder's stale logs raised false alarms and entered the figures
    kids, clog, stop_file = Children(), d / "coordinator.jsonl", d / "stop_at"
    ranks = [(r, p) for r in range(reps) for p in range(pos)]
    counted = d / "coordinator_requests"

    def coord_counts() -> dict[str, int]:
        """The requests the coordinator's clients sent to its main store so far (`total`), the
        decisions it wrote and the total right after the last one (`coordinator_main`)."""
        try:
            return json.loads(counted.read_text())
        except (OSError, ValueError):
            return {"total": 0, "decisions": 0, "at_decision": 0}

    def coord_requests() -> int:
        return coord_counts()["total"]

    def coord_failure(before: dict[str, int], after: dict[str, int]) -> float:
        """The coordinator's main-store requests between two snapshots that a failure-free
        stretch would not have made. Between two decisions (snapshots taken as each was
        written) that is exact: every request but one compare-and-set per decision. Without
        decisions (no store shards: the ranks decide) it is every request."""
        if after["decisions"] > before["decisions"]:
            return (after["at_decision"] - before["at_decision"]
                    - (after["decisions"] - before["decisions"]))
        return after["total"] - before["total"]

    try:
        kids.call("coord", coordinator_main, CoordArgs([
            "--replicas", str(reps), "--port", "0", "--port-file", str(d / "port"),
            "--stale-s", str(a.stale_s), "--join-timeout-s", str(a.timeout_s),
            "--log", str(clog), "--store-shards", str(a.store_shards)], counted),
            d / "coordinator.log")
        wait_for(lambda: (d / "port").exists(), 60, "the coordinator's port file")
        port = int((d / "port").read_text())
        tails = {}
        t0 = time.monotonic()
        for r, p in ranks:
            log = d / f"rank{r}.{p}.jsonl"
            kids.call((r, p), rank_main, RankArgs(
                port, r, p, pos, reps, a.numel, a.compute_s, a.timeout_s, 10**6, log,
                stop_file, os.getpid(), a.trace, speaker=not a.no_speaker),
                d / f"rank{r}.{p}.err")
            tails[(r, p)] = Tail(log)
        fork_s = time.monotonic() - t0
        live = set(range(reps))

        def check(expected_members: set[int]) -> None:
            """Raise if a survivor died or the coordinator dropped a replica we did not kill."""
            kids.reap()
            for k in ranks:
                if k[0] in live and k in kids.code:
                    err = (d / f"rank{k[0]}.{k[1]}.err").read_text(errors="replace")[-1500:]
                    raise ProtocolFailure(f"rank {k} exited {kids.code[k]} unexpectedly:\n{err}")
            for e in generations(clog):
                dropped = sorted(expected_members - set(e["members"]))
                if dropped:
                    time.sleep(0.5)  # its process, if it ended, is reaped by then
                    kids.reap()
                    how = {k: kids.code.get(k, "still running") for k in ranks
                           if k[0] in dropped}
                    raise FalseAlarm(f"generation {e['gen']}: {e.get('reason', '?')}; the "
                                     f"dropped ranks' exit codes: {how}")

        def reached(n: int, keys: list[Any], after_gen: int = -1) -> Callable[[], bool]:
            def cond() -> bool:
                check(live)
                return all(sum(s["gen"] > after_gen for s in tails[k].steps()) >= n
                           for k in keys)
            return cond

        hi = a.warm + a.steps
        wait_for(reached(a.warm, ranks), a.timeout_s * 3, "the warm-up steps on every rank")

        def progress() -> tuple[float, int]:
            """(the coordinator's CPU seconds, the steps every live rank has committed)"""
            return cpu_seconds(kids.pid["coord"]), min(len(tails[k].steps()) for k in ranks
                                                 if k[0] in live)

        c0, n0 = progress()
        q0, ff0 = coord_requests(), coord_counts()
        wait_for(reached(hi, ranks), a.timeout_s * 3, f"{hi} failure-free steps on every rank")
        c1, n1 = progress()
        step_cpu = (c1 - c0) / max(1, n1 - n0)  # the coordinator's CPU per failure-free step
        step_reqs = (coord_requests() - q0) / max(1, n1 - n0)  # its requests, likewise
        # what the exact count finds in failure-free steps: 0 unless the coordinator makes
        # requests besides its decisions (then a failure's count would include them)
        ff_extra = coord_failure(ff0, coord_counts())
        setup_s = time.monotonic() - t0
        pss, rss = pss_mib(kids.unreaped())
        ff = failure_free({k: tails[k].steps() for k in ranks}, a.warm, hi)
        kills = []
        for _ in range(min(a.kills, max(1, reps // 4))):
            g0 = max(e["gen"] for e in generations(clog))
            time.sleep(rng.uniform(0.0, ff["period_s"]))
            victim = (rng.choice(sorted(live)), rng.randrange(pos))
            before = len(live) * pos
            k0, m0 = progress()
            q0 = coord_requests()
            snap = coord_counts()
            t_kill = time.time()
            kids.signal(victim, signal.SIGKILL)
            live.discard(victim[0])
            survivors = [k for k in ranks if k[0] in live]
            # TAIL more commits than the first (the failure's requests are counted over them),
            # and AFTER more (the new membership's failure-free rate, subtracted)
            wait_for(reached(max(a.settle, 1 + TAIL + AFTER), survivors, g0), a.timeout_s * 3,
                     "every survivor's commits in the new generation")
            k1, m1 = progress()
            time.sleep(0.1)  # the coordinator's count file is rewritten every 20 ms
            estimate = coord_requests() - q0 - (m1 - m0) * step_reqs
            coord = coord_failure(snap, coord_counts())
            t_gen = next(e["time"] for e in generations(clog) if e["gen"] > g0)
            everything = {k: tails[k].steps() for k in survivors}
            bd = breakdown({k: [s for s in recs if s["t_commit"] > t_kill]
                            for k, recs in everything.items()}, t_kill, t_gen, g0)
            kills.append({"victim": list(victim), "ranks_before": before, **bd,
                          "store_cpu": max(0.0, k1 - k0 - (m1 - m0) * step_cpu),
                          "recovery_ops": max(0.0, bd["step_ops"] - ff["store_ops"]),
                          "recovery_cpu": recovery_cpu(everything, t_kill, g0),
                          "recovery_cpu_outside": recovery_cpu_outside(everything, t_kill, g0),
                          "coord_estimate": estimate,
                          **failure_requests(everything, t_kill, g0, coord)})
        bad = [(k, s["step"]) for k in ranks for s in tails[k].steps() if not s["correct"]]
        if bad:
            raise ProtocolFailure(f"wrong reduced gradient at (rank, step) {bad[:5]}")
        last = max(s["step"] for k in ranks if k[0] in live for s in tails[k].steps())
        tmp = stop_file.with_suffix(".tmp")
        tmp.write_text(str(last + 3))
        os.replace(tmp, stop_file)  # every survivor stops before the same step, then leaves
        wait_for(lambda: kids.reap() or all(k in kids.code for k in ranks), 60,
                 "the ranks to stop")
    except BaseException:
        dump_stacks(kids, [k for k in ranks if k in kids.pid])
        raise
    finally:
        kids.stop([k for k in ranks if k in kids.pid])
        kids.stop(["coord"])
    return {"ranks": len(ranks), "replicas": reps, "positions": pos, "setup_s": setup_s,
            "fork_s": fork_s,
            "pss_mib": pss, "max_rss_mib": rss, "load": loadavg(), **ff,
            "coord_step_cpu": step_cpu, "coord_step_requests": step_reqs,
            "coord_failure_free_extra": ff_extra,
            "kills": kills, **{p: median([k[p] for k in kills]) for p in EXTRA}}


# -- output ---------------------------------------------------------------------------------
def curve(res: list[dict], source: str = "", store_shards: int = 0) -> dict[str, Any]:
    """The P = 1 scales in the simulator's schema (keep it exactly: `recover.app.sim` reads it).
    With P = 1 each rebuilt cross-replica group has R = ranks members (`group`), and a
    replica's requests are its one rank's."""
    one = sorted((r for r in res if r["positions"] == 1), key=lambda r: r["ranks"])
    return {"source": source, "ranks": [r["ranks"] for r in one],
            "group": [r["replicas"] for r in one],
            # the mean rank's: with shards a shard's last counter's 2 more are the main
            # store's, which the simulator charges apart (2 per shard)
            "store_ops_per_rank_step": [round(r["store_ops_mean"], 3) for r in one],
            "control_plane_s": [round(r["control_s"], 5) for r in one],
            "control_plane_cpu_s": [round(r["control_cpu_s"], 6) for r in one],
            "detect_s": [round(r["detect"], 5) for r in one],
            "agree_s": [round(r["agree"], 5) for r in one],
            "rebuild_s": [round(r["rebuild"], 5) for r in one],
            "rebuild_cpu_s": [round(r["rebuild_cpu"], 5) for r in one],
            "store_cpu_s": [round(r["store_cpu"], 5) for r in one],
            "recovery_store_ops_per_rank": [round(r["recovery_ops"], 3) for r in one],
            "reduce_s": [round(r["reduce"], 5) for r in one],
            "failure_main_requests_per_rank": [round(r["rank_main_reqs"], 2) for r in one],
            "failure_main_chain_requests_per_rank": [round(r["chain_reqs"], 2) for r in one],
            "failure_coordinator_requests": [round(r["coord_reqs"], 2) for r in one],
            "failure_shard_requests_per_member": [round(r["shard_reqs"], 2) for r in one],
            "failure_shard_bytes_per_member": [round(r["shard_bytes"]) for r in one],
            "store_shards": store_shards}


def plot(res: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip(("detect", "agree", "rebuild", "reduce", "control_s"),
                      ("C0", "C1", "C2", "C3", "C4"), strict=True))
    for pos, style in ((1, "-o"), (8, "--s")):
        rs = sorted((r for r in res if r["positions"] == pos), key=lambda r: r["ranks"])
        if not rs:
            continue
        x = [r["ranks"] for r in rs]
        for key, color in colors.items():
            ax.plot(x, [r[key] * 1e3 for r in rs], style, color=color, label=f"{key} (P={pos})")
        bx.plot(x, [r["store_ops"] for r in rs], style, label=f"P={pos}")
    ax.set(xscale="log", yscale="log", xlabel="ranks (R x P)", ylabel="ms",
           title="kill -> committed, and failure-free control plane")
    bx.axhline(4, color="grey", lw=0.8, ls=":")
    bx.set(xscale="log", xlabel="ranks (R x P)", ylabel="round trips",
           title="store round trips per rank per failure-free step", ylim=(0, None))
    for axis in (ax, bx):
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    ap = bench_args(__doc__, "4, 16, 64 ranks, fewer steps (< 3 min)", "2 and 4 ranks, 1 + 3 "
                    "steps, one kill each, the store rate from 2 clients")
    ap.add_argument("--scales", help="comma-separated RxP, e.g. 4x1,16x1 (default by --quick)")
    ap.add_argument("--numel", type=int, default=1024, help="floats per rank's gradient")
    ap.add_argument("--compute-s", type=float, default=0.01, help="sleep per microbatch")
    ap.add_argument("--warm", type=int, help="leading steps not measured (default 2; 1 smoke)")
    ap.add_argument("--steps", type=int, help="measured failure-free steps (8 quick, 20 full, "
                    "3 smoke)")
    ap.add_argument("--kills", type=int, help="kills per scale, one after another (1 quick, 2 "
                    "full; at most R/4)")
    ap.add_argument("--settle", type=int, help="commits in the new generation before the next "
                    "kill / the end (default 2; 1 smoke)")
    ap.add_argument("--stale-s", type=float, default=30.0,
                    help="heartbeat silence = lost (a SIGKILL is seen by the closed liveness "
                         "socket, not by this: it only has to avoid false alarms; 10 s gave one "
                         "at 64 ranks here, where store round trips can stall for 5 s)")
    ap.add_argument("--timeout-s", type=float,
                    help="protocol timeouts; a stuck step is declared after 3x (default 120, "
                         "60 with --quick, 30 with --smoke)")
    ap.add_argument("--store-shards", type=int, default=2,
                    help="the coordinator's store shards (control/shards.py; 0: one store). "
                         "Default 2: a large job runs with shards (about one per 1,000 ranks), "
                         "which take the counts and every rendezvous off the main store")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--retries", type=int, default=1, help="reruns of a scale after a false alarm")
    ap.add_argument("--write-curve", action="store_true", help=f"also write {CURVE}")
    ap.add_argument("--no-speaker", action="store_true",
                    help="P > 1: every rank asks the store (no speaker per replica)")
    ap.add_argument("--trace", action="store_true",
                    help="log every engine store call and key wait with its result to each "
                         "rank's .err log (diagnosis of a protocol failure; slows the ranks)")
    a = ap.parse_args()
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    by_key = {"steps": {"smoke": 3, "quick": 8, "full": 20},
                "timeout_s": {"smoke": 30.0, "quick": 60.0, "full": 120.0},
                "kills": {"smoke": 1, "quick": 1, "full": 2},
                "warm": {"smoke": 1, "quick": 2, "full": 2},
                "settle": {"smoke": 1, "quick": 2, "full": 2},
                "scales": {"smoke": "2x1,4x1,3x2", "quick": "4x1,16x1,64x1",
                           "full": "4x1,16x1,64x1,128x1,8x8,16x8"}}
    defaults(a, {key: by_mode[mode] for key, by_mode in by_key.items()})
    # the store server's CPU per request: (clients, request pairs each)
    a.store_rate = (2, 200) if a.smoke else (8, 1500)
    a.store_bytes = (2, 10) if a.smoke else (4, 100)
    return a


def main() -> int:
    a = parse_args()
    spec = a.scales
    scales = [tuple(int(v) for v in s.split("x")) for s in spec.split(",")]
    root = out_dir(a.out, "scale")
    rng = random.Random(a.seed)
    say(f"scale: R x P in {spec}; {a.numel} float32 per rank, N = R microbatches of "
        f"{a.compute_s * 1e3:.0f} ms (a sleep) each, {a.warm} + {a.steps} failure-free steps, "
        f"then {a.kills} SIGKILL(s) of a random rank; out {root}")
    say(f"assumptions: {cores()} CPU core(s) shared by every rank and the coordinator, load "
        f"average {loadavg():.1f} at start; gloo over 127.0.0.1; stale-s {a.stale_s}; "
        f"processes forked by the standard library's fork server after one `import torch`; "
        "other load is not controlled")
    res: list[dict] = []
    failures: list[dict] = []  # reported, never hidden: they are the library's
    t0 = time.monotonic()
    for reps, pos in scales:
        for attempt in range(a.retries + 1):
            try:
                r = run_scale(reps, pos, a, rng, root / f"r{reps}p{pos}-{attempt}")
                break
            except FalseAlarm as e:
                log.warning("%dx%d: FALSE ALARM (%s); %s", reps, pos, e,
                            "retrying" if attempt < a.retries else "giving up")
            except (ProtocolFailure, TimeoutError) as e:
                where = root / f"r{reps}p{pos}-{attempt}"
                failures.append({"scale": f"{reps}x{pos}", "logs": str(where), "error": str(e)})
                log.error("%dx%d: FAILED (%s); logs and stacks in %s; %s", reps, pos,
                          str(e).splitlines()[0], where,
                          "retrying" if attempt < a.retries else "giving up")
        else:
            raise SystemExit(f"{reps}x{pos}: no valid attempt")
        res.append(r)
        log.info("%dx%d: set up in %.0fs (forks %.1fs), %d failure-free steps (period %.0f ms), "
                 "kill -> committed %.0f ms; PSS %.0f MiB in all, max RSS %.0f MiB; load %.1f; "
                 "%.0fs so far", reps, pos, r["setup_s"], r["fork_s"], r["steps"],
                 r["period_s"] * 1e3, r["total"] * 1e3, r["pss_mib"], r["max_rss_mib"],
                 r["load"], time.monotonic() - t0)
    return report(res, failures, a, root)


def report(res: list[dict], failures: list[dict], a: argparse.Namespace, root: Path) -> int:
    """The table, the curve and detail files, then the figure lines (last)."""
    cols = ("detect", "agree", "teardown", "agree_med", "agree_cpu", "recomp", "rebuild",
            "rebuild_cpu", "reduce", "rest", "store_cpu", "recovery_cpu", "recovery_cpu_outside")
    rows = [(f"{r['replicas']}x{r['positions']}", r["ranks"],
             f"{r['engine_ops']:.2f}/{r['store_ops']:.2f}", f"{r['control_s'] * 1e3:.1f}",
             f"{r['control_cpu_s'] * 1e3:.2f}", f"{r['period_s'] * 1e3:.0f}",
             f"{r['total'] * 1e3:.0f}",
             *(f"{r[p] * 1e3:.0f}" for p in cols), f"{r['recovery_ops']:.1f}",
             f"{r['main_reqs']:.1f}", f"{r['main_max']:.0f}", f"{r['shard_reqs']:.1f}",
             f"{r['shard_bytes'] / 1e3:.1f}", f"{r['pss_mib']:.0f}") for r in res]
    say("")
    table(rows, ("RxP", "ranks", "ops", "ctl", "ctl_cpu", "step", "kill->ok",
                 *(c.replace("recovery_cpu", "rec_cpu").replace("rec_cpu_outside", "rec_out")
                   for c in cols), "rec_ops", "main_req",
                 "main_max", "shard_req", "shard_kB", "PSS MiB"))
    say("  ops: store round trips per rank per failure-free step, engine.stats['store_ops'] / "
        "that plus the engine's blocking key waits; ctl: failure-free control plane (ctl_cpu: "
        "the most CPU a rank spent in it); step: "
        "failure-free step period; times in ms, median over kills; teardown is inside agree, "
        "agree_med is the median survivor's agree (agree: the last survivor's); agree_cpu: the "
        "most CPU a survivor spent from its failed reduce to its next; rebuild_cpu: "
        "that survivor's CPU time (all its threads) over its rebuild; store_cpu: the coordinator's "
        "(store server's) CPU for the recovery, less as many failure-free steps' worth; rec_cpu: "
        "the most CPU a survivor spent from the kill to its commit (rec_out: outside its "
        "communicator's reduce calls); rec_ops: the store round "
        "trips a failure adds to a survivor's step; main_req / shard_req: the requests a failure "
        "added to the main store / the shards, per surviving replica (main_max: the most one "
        "replica added); shard_kB: the value bytes the shards sent it (gloo's addresses)")
    say(f"store shards: {a.store_shards} (" + ("as a large job runs, about one per 1,000 ranks: "
        "the main store serves a failure's agreement, the shards the counts and every "
        "rendezvous" if a.store_shards else "one store serves everything") + "); with P > 1 "
        + ("every rank asks the store (--no-speaker)" if a.no_speaker else "a replica's rank 0 "
           "speaks for it (its ranks' own gloo group: recovery/speaker.py)"))
    loads = [r["load"] for r in res]
    data = curve(res, f"bench/scale.py on {cores()} CPU cores shared by all ranks (load "
                      f"{min(loads):.0f}-{max(loads):.0f}), {time.strftime('%Y-%m-%d')}, "
                      f"{a.numel} floats, gloo over loopback, {a.store_shards} store shards",
                 a.store_shards)
    clients, pairs = a.store_rate
    req = request_cpu_s(root / "store_rate", clients, pairs)
    data["store_request_cpu_s"] = round(req, 9)
    say(f"store server: {req * 1e6:.1f} us of its CPU per request ({clients} client processes x "
        f"{pairs} x (add + get), bench/_store_rate.py): {req * 2 * 100_000:.2f} s of serial work "
        "a step for 100,000 ranks at 2 requests each")
    per_byte = byte_cpu_s(root / "store_bytes", *a.store_bytes)
    data["store_byte_cpu_s"] = per_byte
    say(f"store server: {per_byte * 1e9:.2f} ns of its CPU per value byte it sends ("
        f"{a.store_bytes[0]} client processes x {a.store_bytes[1]} multi_gets of 1 MiB, "
        "bench/_store_rate.py)")
    (root / "scale.json").write_text(json.dumps(data, indent=1) + "\n")
    (root / "scale_detail.json").write_text(json.dumps({"scales": res, "failures": failures},
                                                       indent=1) + "\n")
    plot(res, root / "scale.png")
    if a.write_curve:
        CURVE.parent.mkdir(parents=True, exist_ok=True)
        CURVE.write_text(json.dumps(data, indent=1) + "\n")
        say(f"wrote {CURVE}")
    say(f"wrote {root / 'scale.json'}, {root / 'scale_detail.json'}, {root / 'scale.png'}")
    say(f"protocol failures (a survivor died or a wrong gradient; retried): {len(failures)}"
        + "".join(f"\n  {f['scale']}: {f['error'].splitlines()[0][:150]} ({f['logs']})"
                  for f in failures))
    small, big = (r["ranks"] for r in ends(res))
    rounds = 12 if a.smoke else 24
    runs = [pass_cpu_s(n, rounds) for n in (small, big, small, big)]
    same = ((runs[0] + runs[2]) / 2, (runs[1] + runs[3]) / 2)  # alternated: drift falls on both
    for line in figures(res, a.numel, same):
        print(line, flush=True)
    return 0


def ends(res: list[dict]) -> tuple[dict, dict]:
    """The smallest and the largest scale the ratios compare: of one rank per replica, if any."""
    one = sorted((r for r in res if r["positions"] == 1), key=lambda r: r["ranks"])
    return (one[0], one[-1]) if one else (res[0], res[-1])


def figures(res: list[dict], numel: int, same: tuple[float, float]) -> list[str]:
    """The per-size values (progress lines), then the figure lines, the goals' three last.
    `same`: one fixed pass of work's CPU among as many processes as the smallest and the largest
    size has ranks (`_same_work.pass_cpu_s`)."""
    for r in res:
        say(f"{r['replicas']}x{r['positions']}: store_ops_per_rank_step {r['store_ops']:.2f} "
            f"(the mean rank's {r['store_ops_mean']:.2f}; with shards a shard's last counter "
            "tells the coordinator on its liveness socket, no round trip), "
            f"recovery_cpu {r['recovery_cpu'] * 1e3:.1f} ms, "
            f"main_store_requests_per_failure_per_replica {r['main_reqs']:.2f} (the most one "
            f"replica added: {r['main_max']:.0f}), shard requests {r['shard_reqs']:.1f}, "
            f"probes of the peers' data path per surviving replica {r['probes']:.2f}")
        for k in r["kills"]:
            say(f"  main-store requests per surviving replica by key: coordinator "
                f"{k['coord_reqs'] / max(1, r['replicas'] - 1):.2f} (counted between two of its "
                f"decisions; the old step-rate estimate "
                f"{k.get('coord_estimate', 0) / max(1, r['replicas'] - 1):.2f}; failure-free "
                f"steps gave {r.get('coord_failure_free_extra', 0)} besides its decisions), "
                + ", ".join(f"{kind} {n:.2f}" for kind, n in k.get("main_kinds", {}).items()))
    small, big = ends(res)
    ratio = big["recovery_cpu"] / small["recovery_cpu"]
    wall = (big["detect"] + big["agree"]) / (small["detect"] + small["agree"])
    outside = big["recovery_cpu_outside"] / small["recovery_cpu_outside"]
    ring = big["reduce_cpu_s"] / small["reduce_cpu_s"]
    coll = ("the tree of collectives/tree.py" if 4 * numel <= TREE_MAX_BYTES
            else "gloo's ring of 2(R-1) sends")
    say(f"recovery_cpu_ratio: {big['recovery_cpu'] * 1e3:.1f} ms at {big['ranks']} ranks / "
        f"{small['recovery_cpu'] * 1e3:.1f} ms at {small['ranks']}; of it the rebuild "
        f"{big['rebuild_cpu'] * 1e3:.1f} / {small['rebuild_cpu'] * 1e3:.1f} ms (gloo connects "
        f"a full mesh: O(R) per member); the wall clock's detect + agree ratio {wall:.2f} "
        f"(processor sharing among {big['ranks']} processes on {cores()} cores); goals: "
        "store ops <= 2, CPU ratio <= 1.5, main-store requests <= 4")
    say(f"  outside the communicator's reduce calls (gloo's connect, the collectives, the "
        f"failed op's abandon): {big['recovery_cpu_outside'] * 1e3:.1f} / "
        f"{small['recovery_cpu_outside'] * 1e3:.1f} ms, ratio {outside:.2f}; one failure-free "
        f"reduce call ({coll}, no failure) {big['reduce_cpu_s'] * 1e3:.1f}"
        f" / {small['reduce_cpu_s'] * 1e3:.1f} ms, ratio {ring:.2f}")
    say(f"  the same fixed pass of work (bench/_same_work.py) cost a process "
        f"{same[1] * 1e6:.0f} us of CPU among {big['ranks']} busy processes, {same[0] * 1e6:.0f} "
        f"us among {small['ranks']}: ratio {same[1] / same[0]:.2f}, what this machine adds to "
        "any CPU ratio here for work that does not grow")
    return [f"same_work_cpu_ratio={same[1] / same[0]:.2f}",
            f"recovery_cpu_outside_collective_ratio={outside:.2f}",
            f"failure_free_reduce_cpu_ratio={ring:.2f}",
            f"store_ops_per_rank_step={max(r['store_ops'] for r in res):.2f}",
            f"recovery_cpu_ratio={ratio:.2f}",
            "main_store_requests_per_failure_per_replica="
            f"{max(r['main_reqs'] for r in res):.2f}"]


if __name__ == "__main__":
    sys.exit(main())
