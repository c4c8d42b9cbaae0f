"""The replica process's entry point: `python -m recover.app.train.worker` (or under torchrun).

Invariant: the process ends with the loop's exit code and without interpreter teardown, which can
abort a process whose gloo group a dead peer left mid-operation. Launched by `recover train` (one
process per rank) or by one `torchrun` per replica (env `RECOVER_COORDINATOR=host:port`,
`RECOVER_REPLICA=i`, `RANK` = rank within the replica).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

from recover.app import logs
from recover.errors import ExitCode
from recover.settings import LaunchEnv

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    env = LaunchEnv.from_env()
    logs.setup(env.log_level)
    ap = argparse.ArgumentParser(prog="python -m recover.app.train.worker")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--replica", type=int, default=-1 if env.replica is None else env.replica)
    ap.add_argument("--coordinator", default=env.coordinator)
    ap.add_argument("--rank", type=int, default=env.rank,
                    help="rank within a multi-rank replica (torchrun: RANK, one torchrun per "
                         "replica)")
    ap.add_argument("--gloo-ifname", default=None, metavar="IF",
                    help="network interface for cross-replica traffic (default: the one that "
                         "reaches the coordinator; same as GLOO_SOCKET_IFNAME)")
    args = ap.parse_args(argv)
    if args.gloo_ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.gloo_ifname
    if args.replica < 0 or not args.coordinator:
        log.error("recover worker: need --replica/RECOVER_REPLICA and --coordinator/"
                  "RECOVER_COORDINATOR")
        return ExitCode.USAGE
    from recover.app.train.loop import run  # after argument checks: importing torch takes seconds

    # `kill -USR1 <pid>` prints every thread's stack into the replica's log (a stuck rank).
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    host, port = args.coordinator.rsplit(":", 1)
    return run(Path(args.run_dir), args.replica, args.rank, host, int(port))


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    sys.stdout.flush()
    # Skip interpreter teardown: destroying a gloo group that a dead peer left mid-operation can
    # abort the process ("terminate called without an active exception").
    os._exit(code)
