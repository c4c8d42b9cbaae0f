"""The `recover` command line: train | coordinator | simulate | bench.

Invariant: a user mistake ends in one readable line on stderr and a non-zero exit, never a
traceback; flags map 1:1 onto `RunConfig` fields, and presets only set defaults that flags override.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from pathlib import Path

from recover.config import PRESETS, RunConfig, preset
from recover.errors import RecoverError

_TRAIN_FLAGS: list[tuple[str, str, type, str]] = [
    # (flag, RunConfig field, type, help)
    ("--replicas", "replicas", int, "R: replica processes (default 4)"),
    ("--microbatches", "microbatches", int, "N: microbatches per step, the invariant's unit"),
    ("--microbatch-size", "microbatch_size", int, "B: sequences per microbatch"),
    ("--steps", "steps", int, "optimizer steps"),
    ("--stop-at", "stop_at", int, "stop after this many steps (checkpointed; --resume goes on)"),
    ("--seed", "seed", int, "run seed (data order, init, dropout)"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--min-lr", "min_lr", float, "final learning rate of the cosine decay"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay"),
    ("--grad-clip", "grad_clip", float, "global gradient-norm clip"),
    ("--data", "data", str, "text file/folder or uint16 .bin (default: embedded Shakespeare)"),
    ("--val-fraction", "val_fraction", float, "fraction of tokens held out for validation"),
    ("--eval-every", "eval_every", int, "steps between validation losses"),
    ("--ckpt-every", "ckpt_every", int, "steps between DCP checkpoints (0 = only at the end)"),
    ("--min-replicas", "min_replicas", int, "stop (with a checkpoint) below this many replicas"),
    ("--stale-s", "stale_s", float, "heartbeat silence that declares a replica lost"),
    ("--reduce-timeout-s", "reduce_timeout_s", float, "backstop timeout of one reduction"),
    ("--layout", "layout", str, "replica layout: plain, hsdp, tp, pp or tp,pp (see README)"),
    ("--shards", "shards", int, "hsdp: FSDP2 shard ranks per replica"),
    ("--tp", "tp", int, "tp, tp,pp: tensor-parallel ranks per replica (per stage)"),
    ("--stages", "stages", int, "pp, tp,pp: pipeline stages per replica"),
    ("--policy", "policy", str, "reaction to a lost replica: recover, or shrink-batch (baseline)"),
    ("--dtype", "dtype", str, "autocast dtype of forward/backward: fp32, bf16 or fp16 "
     "(parameters and optimiser stay fp32)"),
    ("--reduce-dtype", "reduce_dtype", str, "dtype of the cross-replica reduce (default: the "
     "gradient's, fp32)"),
    ("--device", "device", str, "cpu or cuda (one GPU per process; plain layout)"),
    ("--backend", "backend", str, "cross-replica communicator: gloo, or nccl (with --device cuda)"),
]
_MODEL_FLAGS: list[tuple[str, str, type, str]] = [
    ("--block-size", "block_size", int, "sequence length"),
    ("--n-layer", "n_layer", int, "transformer blocks"),
    ("--n-head", "n_head", int, "attention heads"),
    ("--n-embd", "n_embd", int, "model width"),
    ("--dropout", "dropout", float, "dropout probability (seeded per microbatch id)"),
    ("--vocab-size", "vocab_size", int, "vocabulary size (bytes: 256)"),
]


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run resilient pre-training on this machine",
                       description="Start a coordinator and R replica processes and train.")
    p.add_argument("--preset", default="debug", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--out", help="run directory (default runs/<preset>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue from DIR's latest checkpoint")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="inject a fault, e.g. kill:replica=2,step=10,phase=backward")
    p.add_argument("--reference", action="store_true",
                   help="also run the failure-free reference and compare trajectories")
    p.add_argument("--external-workers", action="store_true",
                   help="start no replicas here: serve the coordinator on --port and wait for "
                        "replicas launched elsewhere (torchrun), writing metrics")
    p.add_argument("--port", type=int, default=0, help="coordinator store port (0 = any)")
    p.add_argument("--no-speed-aware", action="store_true",
                   help="equal quotas instead of quotas that follow measured replica speed")
    p.add_argument("--exact", action="store_true",
                   help="bitwise-reproducible steps: fixed-point gradient sums that do not depend "
                        "on how microbatches are grouped or which replicas failed")
    p.add_argument("--dump-final-params", action="store_true",
                   help="each finishing replica saves DIR/final/replica<i>.pt (to compare them)")
    for flag, _, typ, hlp in _TRAIN_FLAGS + _MODEL_FLAGS:
        p.add_argument(flag, type=typ, default=None, help=hlp)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    cfg = preset(args.preset)
    for _, name, _, _ in _TRAIN_FLAGS:
        v = getattr(args, name)
        if v is not None:
            setattr(cfg, name, v)
    for _, name, _, _ in _MODEL_FLAGS:
        v = getattr(args, name)
        if v is not None:
            setattr(cfg.model, name, v)
    cfg.out = args.out or f"runs/{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg.resume, cfg.faults, cfg.reference = args.resume, list(args.fault), args.reference
    cfg.dump_final = args.dump_final_params
    cfg.speed_aware = not args.no_speed_aware
    cfg.exact = args.exact
    if args.data is not None and not Path(args.data).exists():
        raise RecoverError(f"--data {args.data}: no such file or directory")
    return cfg.validate()


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from recover.train.launch import launch
    from recover.train.reference import compare_final_params, max_rel_loss_diff, plot_trajectory

    console = Console(stderr=True)
    cfg = config_from_args(args)
    if cfg.reference:
        cfg.dump_final = True  # the final parameters are compared with the reference's too
    if args.external_workers and not args.port:
        raise RecoverError("--external-workers needs a fixed --port for the replicas to reach")
    res = launch(cfg, console, external_workers=args.external_workers, port=args.port)
    if not res.ok:
        print(f"recover train: {res.message}", file=sys.stderr)
        return 1
    _summary(console, res)
    if cfg.reference:
        ref_cfg = dataclasses.replace(cfg, faults=[], reference=False, resume=False,
                                      out=str(Path(cfg.out) / "reference"))
        ref_cfg.model = dataclasses.replace(cfg.model)
        console.print("recover: running the failure-free reference ...", highlight=False)
        ref = launch(ref_cfg, console, quiet=True)
        if not ref.ok:
            print(f"recover train: reference run failed: {ref.message}", file=sys.stderr)
            return 1
        png = Path(cfg.out) / "trajectory.png"
        plot_trajectory(res.records, ref.records, png)
        diff = max_rel_loss_diff(res.records, ref.records)
        equal, rel_l2 = compare_final_params(Path(cfg.out), Path(ref_cfg.out))
        console.print(f"trajectory plot: {png}", highlight=False)
        print(f"final_params_bitwise_equal={str(equal).lower()} final_params_rel_l2={rel_l2:.3e}")
        # Exactly zero is printed as 0: exact mode's promise is that, not a small number.
        print(f"max_rel_loss_diff={diff:.3e}" if diff else "max_rel_loss_diff=0", flush=True)
    return 0


def _summary(console, res) -> None:  # type: ignore[no-untyped-def]
    recs = res.records
    if not recs:
        return
    last = recs[-1]
    gens = last["generation"]
    recovered = sum(len(r["recovered"]) for r in recs)
    tokens = recs[-1]["tokens"] - (recs[0]["tokens"] - recs[0]["tokens"] // (recs[0]["step"] + 1))
    train_s = sum(r["step_time_s"] for r in recs)
    val = next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), float("nan"))
    console.print(
        f"[bold]done[/]: {len(recs)} steps, final loss {last['loss']:.4f}, val loss {val:.4f}, "
        f"{tokens / max(train_s, 1e-9):,.0f} tok/s while training ({res.wall_s:.1f}s wall incl. "
        f"startup), live replicas {last['live_replicas']}, membership changes {gens}, "
        f"microbatches recovered {recovered}; outputs in {res.out}", highlight=False)


def cmd_coordinator(argv: list[str]) -> int:
    from recover.collectives.coordinator import main as coordinator_main

    return coordinator_main(argv)


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "coordinator":
        return cmd_coordinator(argv[1:])
    if argv and argv[0] == "simulate":
        from recover.sim.cli import run_cli

        return run_cli(argv[1:])
    if argv and argv[0] == "bench":
        from recover.baselines.bench import run_cli as bench_cli

        return bench_cli(argv[1:])
    ap = argparse.ArgumentParser(prog="recover", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    _train_parser(sub)
    sub.add_parser("coordinator", help="run the control plane for a multi-node job")
    sub.add_parser("simulate", help="cluster-scale discrete-event simulator")
    sub.add_parser("bench", help="recover vs checkpoint-restart vs shrink-batch, side by side")
    args = ap.parse_args(argv)
    # SIGTERM ends a run like Ctrl-C: the launcher's cleanup ends its children by PID.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.cmd == "train":
            return cmd_train(args)
    except RecoverError as e:
        print(f"recover {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("recover: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
