"""Failure-free overhead of recover's trainer against plain PyTorch DDP, measured side by side.

What: the steady-state time per optimizer step of `recover train` (coordinator + R replica
processes, fault tolerance on, no faults) divided by that of `DistributedDataParallel` with
`no_sync` gradient accumulation (`bench/_ddp.py`) on the same model, data, microbatch ids, N, B,
R, optimizer and clipping; one process per replica, gloo, one intra-op thread each.

How: runs alternate in ABBA order (recover, ddp, ddp, recover, ...) so drift and noise hit both.
A step's time is the commit-to-commit interval (recover: `time_s` deltas in metrics.jsonl, stamped
after the optimizer step; DDP: rank 0's wall clock after its optimizer step), which covers the
whole loop; the first --warmup steps are skipped; medians are pooled over rounds. With --profile
(default) one more recover run with instrumented workers (`bench/_profile.py`) shows where the
step's time goes: compute, the chain/plan agreement, the trailer copy, the allreduce, the commit
decision, store round-trips. Last line: `overhead_ratio=<recover/ddp>`.

    python bench/overhead.py --quick          # debug preset, R=4, < 2 min
    python bench/overhead.py                  # small preset
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    BENCH_DIR,
    cores,
    end,
    field,
    median,
    out_dir,
    periods,
    recover_train,
    say,
    table,
)
from recover.config import preset
from recover.train.launch import prepare_run


def ddp_run(cfg, run: Path, bucket_mb: float, timeout_s: float) -> list[dict]:
    cfg = dataclasses.replace(cfg, out=str(run))
    cfg.model = dataclasses.replace(cfg.model)
    prepare_run(cfg)
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        for r in range(cfg.replicas):
            log = open(run / f"rank{r}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, str(BENCH_DIR / "_ddp.py"), "--run-dir", str(run), "--rank",
                 str(r), "--world", str(cfg.replicas), "--store-file", str(run / "filestore"),
                 "--result", str(run / f"rank{r}.json"), "--bucket-mb", str(bucket_mb)],
                stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"DDP ranks exited {[p.returncode for p in procs]}; see {run}")
    finally:
        end(procs)
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(cfg.replicas)]


def ddp_periods(rec: dict, lo: int, hi: int) -> list[float]:
    e = rec["end"]
    return [e[s] - e[s - 1] for s in range(max(lo, 1), min(hi, len(e)))]


def profile(cfg, root: Path, lo: int, hi: int, timeout_s: float, ddp: list[dict]) -> None:
    from _profile import profiled_run

    cfg = dataclasses.replace(cfg, out=str(root / "profiled"))
    cfg.model = dataclasses.replace(cfg.model)
    say(f"\nprofile: one instrumented recover run ({cfg.out}); per replica-step, steps {lo}.."
        f"{hi - 2} (the last step's tail holds the final eval/checkpoint)")
    reps, coord = profiled_run(cfg, timeout_s)
    samples = [s for steps in reps for s in steps[lo:hi - 1]]
    t_lo, t_hi = reps[0][lo]["t_start"], reps[0][hi - 2]["t_end"]
    window = [c for t, c in coord if t_lo <= t <= t_hi]
    coord_cpu = (window[-1] - window[0]) / (hi - 2 - lo) if len(window) > 1 else float("nan")

    def stat(key: str, f=median) -> float:
        return f([s.get(key, 0.0) for s in samples])

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    for s in samples:
        s["other"] = s["run"] - sum(s.get(k, 0.0) for k in
                                    ("compute", "chain", "reduce", "decide", "speed"))
        s["trailer"] = s.get("reduce", 0.0) - s.get("allreduce", 0.0)
        s["period"] = s["run"] + s.get("loop", 0.0)
        s["rtt"] = sum(v for k, v in s.items() if k.startswith("rtt:"))
        s["store_s"] = sum(v for k, v in s.items() if k.startswith("store_s:"))
    rows = []
    for key, what in (("period", "whole loop (run + loop)"), ("run", "engine.run"),
                      ("compute", "  fwd+bwd of own microbatches"),
                      ("chain", "  plan/chain agreement (_sync_chain)"),
                      ("reduce", "  _reduce (trailer + allreduce + verify)"),
                      ("allreduce", "    comm.reduce (clone + gloo allreduce + poll)"),
                      ("trailer", "    torch.cat trailer copy + verify"),
                      ("decide", "  commit decision (_decide)"),
                      ("speed", "  speed publish (_record_speed)"),
                      ("other", "  rest: out/{me} set, grad.copy_, hooks"),
                      ("loop", "outside run: lr, clip, AdamW, record")):
        rtt = stat(f"rtt:{key}", mean) if key not in ("period", "trailer", "allreduce") else 0
        if key == "run":
            rtt = stat("rtt", mean) - stat("rtt:loop", mean)
        rows.append((what, f"{stat(key) * 1e3:.2f}", f"{stat(key, mean) * 1e3:.2f}",
                     f"{rtt:.1f}" if rtt else "",
                     f"{stat(f'store_s:{key}', mean) * 1e3:.2f}" if rtt else ""))
    table(rows, ("phase", "median ms", "mean ms", "store rtt/step", "store ms/step"))
    say(f"  store round-trips per replica-step: {stat('rtt', mean):.1f} "
        f"({stat('store_s', mean) * 1e3:.2f} ms/step of blocking store calls)")
    ddp_cpu = [c[s] - c[s - 1] for c in (r["cpu"] for r in ddp) for s in range(max(lo, 1), hi)]
    say(f"  CPU seconds per step (process clocks, all threads; robust to other load): recover "
        f"{stat('cpu') * 1e3:.1f} ms per replica + coordinator {coord_cpu * 1e3:.1f} ms; DDP "
        f"{median(ddp_cpu) * 1e3:.1f} ms per rank -> CPU ratio "
        f"{(stat('cpu') + coord_cpu / len(reps)) / median(ddp_cpu):.3f} (coordinator shared out)")
    d = [x for r in ddp for x in r["step_s"][lo:hi]]
    say(f"  DDP for comparison (last run, all ranks): step {median(d) * 1e3:.2f} ms = "
        f"no_sync microbatches {median([x for r in ddp for x in r['accum_s'][lo:hi]]) * 1e3:.2f}"
        f" + last microbatch incl. allreduce "
        f"{median([x for r in ddp for x in r['last_s'][lo:hi]]) * 1e3:.2f} + clip/AdamW "
        f"{median([x for r in ddp for x in r['opt_s'][lo:hi]]) * 1e3:.2f} ms (medians)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="debug preset, 2 rounds (< 2 min)")
    ap.add_argument("--out", help="folder for the runs (default: a new temp dir)")
    ap.add_argument("--preset", help="model/data preset (default small; debug with --quick)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--steps", type=int, help="steps per run (default 40 quick, 60 full)")
    ap.add_argument("--warmup", type=int, default=5, help="leading steps not timed")
    ap.add_argument("--rounds", type=int, help="recover/DDP pairs (default 2 quick, 3 full)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    ap.add_argument("--no-profile", action="store_true", help="skip the instrumented run")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per run")
    a = ap.parse_args()
    name = a.preset or ("debug" if a.quick else "small")
    steps = a.steps or (40 if a.quick else 60)
    rounds = a.rounds or (2 if a.quick else 3)
    root = out_dir(a.out, "overhead")
    cfg = preset(name)
    cfg.replicas, cfg.steps, cfg.eval_every = a.replicas, steps, 0
    m = cfg.model
    say(f"overhead: recover train vs DDP(no_sync), preset {name}: d={m.n_embd} L={m.n_layer} "
        f"T={m.block_size}, N={cfg.microbatches} B={cfg.microbatch_size} R={cfg.replicas}, "
        f"{steps} steps/run, first {a.warmup} untimed, {rounds} round(s) ABBA, out {root}")
    say(f"assumptions: {cores()} CPU core(s) for {cfg.replicas} replica processes (+ coordinator"
        f" and launcher for recover); torch.set_num_threads(1) everywhere; gloo on 127.0.0.1; "
        f"eval only after the last step (--eval-every 0), checkpoint only at the end; DDP "
        f"bucket_cap_mb={a.bucket_mb}, gradient_as_bucket_view=True; step time = commit-to-"
        f"commit interval; the recover side includes its launcher polling the store")
    flags = ["--replicas", str(cfg.replicas), "--steps", str(steps), "--eval-every", "0"]
    rows, rec_all, ddp_all, last_ddp = [], [], [], []
    for k in range(rounds):
        for kind in (("recover", "ddp") if k % 2 == 0 else ("ddp", "recover")):
            t0 = time.monotonic()
            if kind == "recover":
                recs = recover_train(root / f"recover{k}", name, flags, a.timeout_s)
                per = periods(recs, a.warmup, steps)
                own = field(recs, "step_time_s", a.warmup, steps)
                rec_all += per
            else:
                last_ddp = ddp_run(cfg, root / f"ddp{k}", a.bucket_mb, a.timeout_s)
                per = ddp_periods(last_ddp[0], a.warmup, steps)
                own = last_ddp[0]["step_s"][a.warmup:]
                ddp_all += per
            rows.append((kind, k, len(per), f"{median(per) * 1e3:.1f}",
                         f"{median(own) * 1e3:.1f}", f"{time.monotonic() - t0:.1f}"))
            say(f"  {kind} round {k}: median {median(per) * 1e3:.1f} ms/step")
    say("")
    table(rows, ("run", "round", "steps", "median step ms", "own timer ms", "wall s"))
    ratio = median(rec_all) / median(ddp_all)
    say(f"recover median {median(rec_all) * 1e3:.2f} ms/step, DDP median "
        f"{median(ddp_all) * 1e3:.2f} ms/step (pooled over {rounds} round(s)); goal <= 1.03")
    if not a.no_profile:
        profile(cfg, root, a.warmup, steps, a.timeout_s, last_ddp)
    print(f"overhead_ratio={ratio:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
