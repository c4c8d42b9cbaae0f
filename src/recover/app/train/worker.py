"""The replica process's entry point: `python -m recover.app.train.worker` (or under torchrun).

Invariant: the process ends with the loop's exit code and without interpreter teardown, which can
abort a process whose gloo group a dead peer left mid-operation. Launched by `recover train` (one
process per rank) or by one `torchrun` per replica (env `RECOVER_COORDINATOR=host:port`,
`RECOVER_REPLICA=i`, `RANK` = rank within the replica). A bad flag or variable, or a run directory
without a valid config.json or run token, ends in one line and exit 2 (`usage_line`, as
`recover train`) before the loop starts: nothing is joined, nothing is written.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from recover.app import logs
from recover.app.rundir import CONFIG, COORDINATOR_FAILED, COORDINATOR_PORT
from recover.deadline import poll_until
from recover.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    RecoverError,
    UsageParser,
    usage_line,
)
from recover.settings import Bounds, LaunchEnv, Number, parse_address

if TYPE_CHECKING:  # recover.app.config imports torch: not before the checks that do not
    from recover.app.config import CheckedConfig

log = logging.getLogger(__name__)

PROG = "python -m recover.app.train.worker"
ID = Bounds(0)  # a replica id or a rank: >= 0 (the run's config.json bounds them above)
WAIT = Bounds(0, 86_400)  # --wait-s: a day at most (a typo of hours must not hang a task)
POLL_S = 0.2


class Where(NamedTuple):
    """Which rank of which replica this process is, of which run, and where its coordinator is;
    and the run's config.json, checked (`check`: the rank's one check, handed to the loop)."""

    run_dir: Path
    replica: int
    rank: int
    host: str
    port: int
    config: CheckedConfig | None = None


def parser() -> UsageParser:
    ap = UsageParser(prog=PROG, description="One rank of one replica of a `recover train` run.")
    ap.add_argument("--run-dir", required=True, metavar="DIR",
                    help="the run directory (its config.json and run.token; recover train "
                         "writes them)")
    ap.add_argument("--replica", type=Number(int, ID), default=None,
                    help="this replica's id, in [0, R) (default: RECOVER_REPLICA)")
    ap.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                    help="the coordinator's store address (default: RECOVER_COORDINATOR)")
    ap.add_argument("--rank", type=Number(int, ID), default=None,
                    help="rank within a multi-rank replica (torchrun: RANK, one torchrun per "
                         "replica)")
    ap.add_argument("--gloo-ifname", default=None, metavar="IF",
                    help="network interface for cross-replica traffic (default: the one that "
                         "reaches the coordinator; same as GLOO_SOCKET_IFNAME)")
    ap.add_argument("--wait-s", type=Number(float, WAIT), default=0.0, metavar="S",
                    help="wait up to S seconds for the run directory's config.json and "
                         "coordinator.port (a scheduler starts the coordinator and the "
                         "replicas together); end at once if it holds coordinator.failed")
    return ap


def main(argv: list[str] | None = None) -> int:
    logs.setup(LaunchEnv.from_env().log_level)
    ap = parser()
    args = ap.parse_args(argv)
    try:
        WAIT.check("--wait-s", args.wait_s, integer=False)
        _await_config(Path(args.run_dir), args.wait_s)
        where = check(args.run_dir, args.replica, args.rank, args.coordinator, args.gloo_ifname)
    except RecoverError as e:
        return usage_line(ap.prog, e)
    if args.gloo_ifname is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = args.gloo_ifname
    from recover.app.train.loop import run  # after argument checks: importing torch takes seconds

    # `kill -USR1 <pid>` prints every thread's stack into the replica's log (a stuck rank).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return run(*where)
    # The run's config, data or checkpoint, found wanting as the rank sets up: not every
    # RecoverError, since a run's fault (ReplicaFault, CoordinatorLost, ...) is one too and ends
    # with its traceback and its own exit code, never as a usage error.
    except (ConfigError, DataError, CheckpointError) as e:
        return usage_line(ap.prog, e)


def check(run_dir: str, replica: int | None, rank: int | None, coordinator: str | None,
          gloo_ifname: str | None) -> Where:
    """The flags, the launcher's variables (those given as flags win) and the run directory,
    checked; ConfigError (one line) on the first that is wrong."""
    env = LaunchEnv.from_env(strict=True)
    replica = env.replica if replica is None else replica
    if replica is None:
        raise ConfigError("need --replica (or RECOVER_REPLICA): this replica's id")
    rank = env.rank if rank is None else rank
    ID.check("--replica", replica, integer=True)
    ID.check("--rank", rank, integer=True)
    coordinator = env.coordinator if coordinator is None else coordinator
    if coordinator is None:
        raise ConfigError("need --coordinator HOST:PORT (or RECOVER_COORDINATOR)")
    host, port = parse_address(coordinator, "--coordinator")
    if gloo_ifname is not None:
        _check_interfaces(gloo_ifname)
    where = Where(Path(run_dir), replica, rank, host, port)
    return where._replace(config=_check_run_dir(where))


def _await_config(run_dir: Path, wait_s: float) -> None:
    """Return once DIR/config.json exists and, when waiting at all (a scheduler started this
    task beside the coordinator), the coordinator listens (DIR/coordinator.port); or after
    wait_s (then `check` names what is missing, or the connect's own bound applies). The
    launcher writes DIR/run.token before config.json, and config.json by a rename: once it
    exists, both are whole. ConfigError (one line) if the coordinator could not start
    (DIR/coordinator.failed): dialling its port would reach whatever holds it."""
    if wait_s <= 0:
        return

    # os.path.isfile: a name the file system refuses is "not there", for `check` to name.
    def ready() -> bool:
        if os.path.isfile(run_dir / COORDINATOR_FAILED):
            why = (run_dir / COORDINATOR_FAILED).read_text(errors="replace").strip()
            raise ConfigError(f"{run_dir}: {why or 'the coordinator did not start'}")
        return all(os.path.isfile(run_dir / name) for name in (CONFIG, COORDINATOR_PORT))

    poll_until(ready, wait_s, POLL_S)


def _check_interfaces(names: str) -> None:
    """Each of the comma-separated interfaces (gloo takes a list) exists on this host."""
    have = sorted(name for _, name in socket.if_nameindex())
    for name in names.split(","):
        if name not in have:
            raise ConfigError(f"--gloo-ifname {names!r}: no interface {name!r} on this host "
                              f"(it has {', '.join(have)})")


def _check_run_dir(where: Where) -> CheckedConfig:
    """The run directory holds a valid config.json, which this replica and rank belong to, and
    the run's token (the file, or RECOVER_RUN_TOKEN); that config, checked."""
    from recover.app.runtoken import run_token

    d = where.run_dir
    try:
        if not str(d).strip() or not d.is_dir():
            raise ConfigError(f"--run-dir {str(d)!r}: no such directory")
        if not (d / CONFIG).is_file():
            raise ConfigError(f"--run-dir {d} holds no config.json: start the workers once "
                              "recover train (--external-workers) has written it")
    except OSError as e:  # a name too long for the file system, a folder it may not enter
        raise ConfigError(f"--run-dir {d}: {e.strerror or e}") from None
    run_token(d)  # a ConfigError that names the missing token and where it was looked for
    from recover.app.config import RunConfig  # imports torch: after the checks that do not

    checked = RunConfig.load(d / CONFIG).checked()
    cfg = checked.cfg
    if where.replica >= cfg.layout.replicas:
        raise ConfigError(f"--replica {where.replica} is not in [0, {cfg.layout.replicas}): the "
                          "run's replica ids (config.json)")
    nranks = cfg.layout.ranks_per_replica()
    if where.rank >= nranks:
        raise ConfigError(f"--rank {where.rank} is not in [0, {nranks}): --layout "
                          f"{cfg.layout.name} has {nranks} rank(s) per replica")
    return checked


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    sys.stdout.flush()
    # Skip interpreter teardown: destroying a gloo group that a dead peer left mid-operation can
    # abort the process ("terminate called without an active exception").
    os._exit(code)
