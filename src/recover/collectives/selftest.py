"""A reduction loop on real processes: the probe behind `bench/recovery.py` and the layer-1 tests.

Invariant checked on every iteration: a reduce that returns holds exactly the sum over the
generation's members of (replica id + 1) in every element; a reduce that raises does so on this
survivor within the timeout. One JSON line per event goes to stdout (or --log).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from recover.collectives import ReplicaFault, connect
from recover.control import Identity, Member
from recover.settings import FaultTolerance, LaunchEnv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recover.collectives.selftest")
    ap.add_argument("--coordinator", required=True, help="host:port of the store")
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--until", type=float, default=0.0,
                    help="wall-clock time (epoch s) to stop at, shared by all replicas")
    ap.add_argument("--compute-s", type=float, default=0.0, help="busy compute between reduces")
    ap.add_argument("--sleep-s", type=float, default=0.0,
                    help="idle time between reduces: a step's length without its CPU")
    ap.add_argument("--stale-s", type=float, default=2.0)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("--log")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = open(args.log, "a", buffering=1) if args.log else sys.stdout
    host, port = args.coordinator.rsplit(":", 1)

    def log(**rec: object) -> None:
        out.write(json.dumps({"t": time.time(), "replica": args.replica, **rec}) + "\n")
        out.flush()

    ft = FaultTolerance(stale_s=args.stale_s, reduce_timeout_s=args.timeout_s,
                        join_timeout_s=args.timeout_s)
    member = Member(host, int(port), args.replica, ft=ft,
                    identity=Identity(token=LaunchEnv.from_env().token))
    comm = connect(member, ft)
    log(event="joined", gen=member.generation(), members=member.members())
    x = torch.randn(256, 256)
    # Two buffers, touched once: a reduce refills its buffer in place, and after a fault the
    # spare takes over (an abandoned operation may still write into the old one), so the probe's
    # own 40 MB allocation and page faults are not timed as part of a recovery.
    bufs: list[torch.Tensor | None] = [torch.zeros(args.numel), torch.zeros(args.numel)]
    i = 0
    while (i < args.iters) if not args.until else (time.time() < args.until):
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.compute_s:
            x = torch.tanh(x @ x.T / 256.0)  # real CPU load, like a training step
        time.sleep(args.sleep_s)
        g = member.generation()
        members = member.members(g)
        if bufs[0] is None:  # both were handed to abandoned operations
            bufs[0] = torch.zeros(args.numel)
        res = bufs[0].fill_(float(args.replica + 1))
        t1 = time.monotonic()
        try:
            comm.reduce_([res], g)
        except ReplicaFault as e:
            # held: an abandoned operation may still write into `res` (gloo waits on a hung peer)
            log(event="fault", gen=g, lost=e.lost, why=e.why, wait_s=time.monotonic() - t1,
                held=comm.in_use(res))
            bufs = [bufs[1], None]
            if member.generation() == g:
                member.wait_newer(g, args.timeout_s)
            continue
        expected = float(sum(m + 1 for m in members))
        ok = bool(torch.all(res == expected))
        log(event="reduce", i=i, gen=g, members=members, ok=ok, sum=float(res[0]),
            expected=expected, reduce_s=time.monotonic() - t1,
            **{k: v for k, v in comm.stats.items()
               if k in ("build_s", "barrier_s", "probes", "tree_ops")})
        if not ok:
            return 1
        if bufs[1] is None:  # a new spare, after the reduce that ended a recovery
            bufs[1] = torch.zeros(args.numel)
        i += 1
    member.leave()
    log(event="done", gen=member.generation(), i=i)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip interpreter teardown: destroying a gloo group that a dead peer left mid-operation can
    # abort the process ("terminate called without an active exception").
    os._exit(code)
