"""Soak: consecutive `recover train` runs under a random, seeded fault schedule for M minutes
(replica kills, hangs, slowdowns, deadlocks, partitions, preemptions, restarts of the lost, and
coordinator kills: every kind `--fault` has). Half the runs reduce in 0.05 MiB buckets, the
first ones issued inside the last backward (`--bucket-mb 0.05`), and may aim their faults at
that phase too (`bucket`).

Invariant: every run is checked the way tests/faults checks one scenario (exit 0, committed
steps 0..S-1 exactly once, `microbatches` = N on every line, losses within 1e-5 relative of a
failure-free reference, surviving replicas' final parameters bitwise equal, the last checkpoint
loads and equals them); each broken check is one violation. Replica 0 is never faulted, so a run
always has a survivor. The last line printed is `violations=<n>` (goal: 0 over 30 minutes).
Every process a run starts is ended by its PID (`recover.procs`), never by process group.

    python bench/soak.py --smoke                  # R=3, 8 steps: the reference + one run, 1 kill
    python bench/soak.py --minutes 30 [--seed 0] [--out DIR] [--hsdp] [--exact]

`--hsdp`: every replica is 2 ranks (HSDP shards; a replica's rank 0 speaks for it to the store,
recovery/speaker.py), each fault aimed at either rank; the survivors' final parameters are
compared rank by rank, and the last checkpoint is verified (HMAC, every file's sha256), not
loaded. `--exact`: every run (the reference too) in exact mode, and the checks bitwise: every
step's loss equal to the reference's, and the survivors' final parameters equal to the
reference's own (docs/DESIGN.md, "Exact mode").
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from _common import fresh_dir, log_progress
from harness.runs import bitwise_equal
from recover.app import rundir
from recover.app.config import RunConfig
from recover.app.runtoken import run_token
from recover.app.train.checkpoint.dcp import latest_checkpoint, load_checkpoint, verify_checkpoint
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer
from recover.procs import descendants, kill_pids, start, stop

log = logging.getLogger("bench.soak")
N = 8  # the debug preset's microbatches per step
PHASES = ("forward", "backward", "reduce", "commit", "optimizer")


@dataclass(frozen=True)
class Shape:
    """The runs' size, and which faults a schedule may draw."""

    replicas: int = 4
    steps: int = 14
    max_faults: int = 3  # faulted replicas per run (at most replicas - 1)
    kinds: tuple[str, ...] = ("kill", "kill", "hang", "slow", "deadlock", "partition",
                              "preempt")
    coordinator_kills: bool = True  # in a third of the runs
    overlap: bool = True  # half the runs reduce in small buckets inside the backward
    layout: tuple[str, ...] = ()  # e.g. HSDP: every replica 2 ranks (its rank 0 the speaker)
    exact: bool = False  # every run in exact mode, checked bit for bit against the reference

    def flags(self) -> list[str]:
        return ["--preset", "debug", "--steps", str(self.steps), "--eval-every", "0",
                "--warmup-steps", "3", "--replicas", str(self.replicas), "--dump-final-params",
                "--ckpt-every", "5", *self.layout, *(["--exact"] if self.exact else [])]


FULL = Shape()
# --smoke: the reference and one run with one replica kill (maybe restarted), as small as the
# checks still see a recovery (R=3: two survivors reduce together after it).
SMOKE = Shape(replicas=3, steps=8, max_faults=1, kinds=("kill",), coordinator_kills=False,
              overlap=False)
BUCKETS = ["--bucket-mb", "0.05"]  # the debug model's gradient in 10 operations a step
HSDP = ("--layout", "hsdp", "--shards", "2")


def train(out: Path, data: Path, faults: list[str], shape: Shape, timeout: float = 300,
          extra: tuple[str, ...] = ()) -> int:
    """Run `recover train`; its exit code (-1 past `timeout`). Its whole tree is ended by PID."""
    fresh_dir(out)  # `recover train` refuses a folder that holds a run (a reused --out)
    args = [sys.executable, "-m", "recover", "train", "--out", str(out), "--data", str(data),
            *shape.flags(), *extra]
    for f in faults:
        args += ["--fault", f]
    Path(f"{out}.log").unlink(missing_ok=True)
    p = start(args, Path(f"{out}.log"))
    kids: list[int] = []
    try:
        deadline = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline:
            kids = sorted(set(kids) | set(descendants(p.pid)))  # seen while the launcher lives
            time.sleep(0.2)
        return -1 if p.poll() is None else p.returncode
    finally:
        if p.poll() is None:
            kids = sorted(set(kids) | set(descendants(p.pid)))
            stop(p, grace_s=10.0, sig=signal.SIGINT)  # SIGINT: its finally ends its workers
        kill_pids(kids)  # only those still alive (by PID, checked in /proc)


def schedule(rng: random.Random, shape: Shape, phases: tuple[str, ...] = PHASES) -> list[str]:
    """1..max_faults faults on distinct replicas among 1..R-1: kill, deadlock, partition or
    preempt (a scheduler's SIGTERM: a planned leave; each maybe followed by the lost replica's
    restart), hang, slow; and in a third of the runs, the
    coordinator SIGKILLed (by replica 0, at a random point; the launcher restarts it with
    --recover)."""
    faults, steps = [], shape.steps
    if shape.coordinator_kills and rng.random() < 1 / 3:
        faults.append(f"coordinator:replica=0,step={rng.randrange(1, steps - 1)},"
                      f"phase={rng.choice(phases)}")
    for r in rng.sample(range(1, shape.replicas), rng.randint(1, shape.max_faults)):
        kind, step = rng.choice(shape.kinds), rng.randrange(1, steps - 3)
        # a multi-rank replica: aim at its speaker (rank 0) or the other rank
        at = f",rank={rng.randrange(2)}" if shape.layout else ""
        if kind in ("kill", "deadlock", "preempt"):
            faults.append(f"{kind}:replica={r},step={step},phase={rng.choice(phases)}{at}")
        elif kind == "partition":
            faults.append(f"partition:replica={r},step={step}{at}")
        if kind in ("kill", "deadlock", "partition", "preempt"):
            if rng.random() < 0.4:
                faults.append(f"restart:replica={r},step={rng.randrange(step + 2, steps)}")
        elif kind == "hang":  # inside the step: from the forward to the reduce
            inside = [p for p in phases if p not in ("commit", "optimizer")]
            faults.append(f"hang:replica={r},step={step},seconds={rng.choice((1, 3, 5))},"
                          f"phase={rng.choice(inside)}{at}")
        else:
            faults.append(f"slow:replica={r},factor={rng.choice((2, 3))},step={step}{at}")
    return faults


def violations(out: Path, rc: int, ref: Path, steps: int, exact: bool = False) -> list[str]:
    """The run's broken checks against the reference run `ref` (bitwise where `exact`)."""
    if rc != 0:
        return [f"exit {rc}"]
    bad = []
    recs = [json.loads(x) for x in (out / rundir.METRICS).read_text().splitlines() if x]
    if [r["step"] for r in recs] != list(range(steps)):
        bad.append("steps not contiguous")
    if any(r["microbatches"] != N for r in recs):
        bad.append("microbatches != N")
    ref_losses = [json.loads(x)["loss"] for x in (ref / rundir.METRICS).read_text().splitlines()
                  if x]
    rel = max((abs(r["loss"] - y) / abs(y) for r, y in zip(recs, ref_losses, strict=False)),
              default=1.0)
    if rel >= 1e-5 or (exact and [r["loss"] for r in recs] != ref_losses):
        bad.append(f"loss off by {rel:.2e}" + (" (exact mode: not bitwise)" if exact else ""))
    by_rank = _finals(out)
    if not by_rank or any(not bitwise_equal(fs[0], f) for fs in by_rank.values() for f in fs):
        bad.append("survivors' final parameters differ (or none)")
    elif exact:
        want = _finals(ref)  # loaded once per run, not once per rank
        if any(k not in want or not bitwise_equal(fs[0], want[k][0]) for k, fs in by_rank.items()):
            bad.append("final parameters differ from the reference's (exact mode)")
    finals = by_rank.get("", [])
    try:
        cfg = RunConfig.load(out / rundir.CONFIG)
        model = build_model(cfg.model, cfg.run.seed + 1)
        key = run_token(out)
        path = latest_checkpoint(out / rundir.CKPT, key)
        assert path is not None, "no checkpoint"
        if cfg.layout.name != "plain":  # verified (HMAC, every file's sha256), not loaded
            meta = verify_checkpoint(path, key)
        else:
            meta = load_checkpoint(path, model, build_optimizer(model, cfg), key=key)
        if meta["step"] != steps or (finals and not bitwise_equal(model.state_dict(), finals[0])):
            bad.append(f"last checkpoint (step {meta['step']}) is not the final state")
    except Exception as e:  # any failure to load is the violation being counted
        bad.append(f"checkpoint does not load: {e}")
    return bad


def _finals(out: Path) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The final parameters each replica dumped, by rank ("" on a one-rank replica)."""
    by_rank: dict[str, list[dict[str, torch.Tensor]]] = {}
    for p in sorted((out / rundir.FINAL).glob("*.pt")):  # replica{r}[.rank{k}].pt: compare per rank
        by_rank.setdefault(p.stem.partition(".")[2], []).append(torch.load(p, weights_only=True))
    return by_rank


def main() -> int:
    log_progress()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, help="how long to go on starting runs")
    ap.add_argument("--smoke", action="store_true", help="R=3, 8 steps: the reference and one "
                    "run with one kill (a few seconds; CI runs it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here (default: tmp)")
    ap.add_argument("--hsdp", action="store_true", help="every replica 2 ranks (HSDP), faults "
                    "aimed at either (its rank 0 speaks for it to the store)")
    ap.add_argument("--exact", action="store_true", help="every run in exact mode (--exact), "
                    "each checked bit for bit against the reference")
    args = ap.parse_args()
    if (args.minutes is None) == (not args.smoke):
        ap.error("give --minutes M or --smoke")
    shape = SMOKE if args.smoke else FULL
    if args.hsdp:
        shape = replace(shape, layout=HSDP, overlap=False)  # buckets: the plain layout's
    if args.exact:  # exact mode reduces after the last fold: no buckets inside the backward
        shape = replace(shape, exact=True, overlap=False)
    root = args.out or Path(tempfile.mkdtemp(prefix="recover-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    data = root / "text.txt"
    rng = random.Random(args.seed)
    words = "the of and to in is that it was for on are with as his they be at one".split()
    data.write_text(" ".join(rng.choice(words) for _ in range(40_000)))
    if train(root / "ref", data, [], shape) != 0:
        log.error("reference run failed: see %s/ref.log", root)
        print("violations=1")
        return 1
    total, runs = 0, 0
    deadline = time.monotonic() + 60 * (args.minutes or 0)
    while runs == 0 or time.monotonic() < deadline:  # --smoke: exactly one run
        extra = BUCKETS if shape.overlap and rng.random() < 0.5 else []
        faults = schedule(rng, shape, PHASES + ("bucket",) if extra else PHASES)
        out = root / f"run{runs:03d}"
        t0 = time.monotonic()
        bad = violations(out, train(out, data, faults, shape, extra=tuple(extra)), root / "ref",
                         shape.steps, shape.exact)
        total += len(bad)
        print(f"run {runs}: {' '.join(faults)}{' (' + ' '.join(extra) + ')' if extra else ''} "
              f"-> {'ok' if not bad else '; '.join(bad)} ({time.monotonic() - t0:.0f}s)",
              flush=True)
        runs += 1
    print(f"runs={runs} (in {root})")
    print(f"violations={total}")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
