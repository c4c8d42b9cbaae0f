"""The coordinator's process: its store servers, its parameters in the store, its loop, and
`main` (`recover coordinator`, `python -m recover.control.coordinator`). The liveness listener and
its connections are `recover.control.liveness`'s; the membership decisions are
`recover.control.membership.Membership`'s; its event log is `recover.control.eventlog`'s.

Invariants: the coordinator runs in its own process, so the store survives any worker's death
(docs/DESIGN.md, "Processes and roles"), and no input crashes its loop (the listener's
invariant). Its parameters in the store are sealed and put back within REASSERT_S of a rewrite;
its event log never stops it (`EventLog`). It pings every liveness connection at least every
PING_S (and every stale_s / 4), so a member that hears nothing for 3 x stale_s knows it is cut
off (recover.control.member); time the loop itself was stalled is not counted as a member's
silence. A connection that has not said an accepted hello (a stranger) is dropped HELLO_S after
it was accepted (`recover.control.liveness`). Ports: the store's, and the liveness listener's
(store port + 1 when the store port is fixed, so a firewall can be opened for both ahead of time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed import TCPStore

from recover.control import keys, listen, netif, sealed, shards
from recover.control.admission import proof
from recover.control.coordconfig import CoordinatorConfig
from recover.control.eventlog import NOISY_BURST as NOISY_BURST  # its bound, named here too
from recover.control.eventlog import EventLog
from recover.control.liveness import LivenessListener
from recover.control.membership import DEBOUNCE_S, Membership
from recover.control.storecount import CountedStore, Tally
from recover.errors import ConfigError, ExitCode, RecoverError, UsageParser, usage_line
from recover.settings import LaunchEnv

log = logging.getLogger(__name__)

HB_CHECK_S = 0.05  # judge silence at most this often (heartbeats are lines on the socket)
STATS_S = 2.0  # the store-request figure (`stats_path`) is rewritten at most this often
STALL_S = 0.5  # a gap between two turns of the loop longer than this is the coordinator's own
# How often the coordinator's parameters in the store are checked and put back (`_reassert`):
# two requests a turn, against a starting member's wait for authentic ones (member.py).
REASSERT_S = 0.25
PING_S = 0.25  # longest gap between two bytes to a member (members fence after 3 x stale_s)
# A member sends its hello in the same call that connects (recover.control.member): a
# connection silent this long after its accept is not a member's (the listener's `hello_s`).
HELLO_S = 10.0
# Its own lines on stderr begin so; the launcher quotes what follows on the last one when it did
# not start (why: the port taken, a bad flag).
LINE_PREFIX = "recover coordinator: "


class Coordinator:
    """Hosts the store and the liveness listener, and runs the membership over them. Call
    `start()` then `serve(stop)`."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.expected, self.host, self.port = config.replicas, config.host, config.port
        self.stale_s = config.stale_s
        self.store_shards = config.store_shards if config.store_shards > 1 else 0
        self.shards: list[TCPStore] = []
        self.top: shards.TreeTop | None = None  # decides for the shards' leaders (with shards)
        # None: store port + 1 for a fixed store port (predictable for firewalls), else any.
        self.liveness_port = config.liveness_port
        self.log_path = config.log_path
        self.exit_when_done = config.exit_when_done
        self.ping_s = min(PING_S, config.stale_s / 4)
        self._log = EventLog(config.log_path)
        self.requests = Tally()  # this process's own main-store requests
        self._stats: tuple[float, int] = (0.0, -1)  # when written, what
        self._pinged = 0.0
        self._hb_checked = 0.0
        # The liveness listener and its connections: the membership's Wire.
        self.liveness = LivenessListener(config.token, self._log, HELLO_S)
        self.membership: Membership | None = None  # made by start(), with the store

    # The membership's state, for tests and tools (read-only).
    @property
    def generation(self) -> int:
        return self.membership.generation if self.membership else -1

    @property
    def members(self) -> list[int]:
        return self.membership.members if self.membership else []

    @property
    def exits(self) -> dict[int, str]:
        return self.membership.exits if self.membership else {}

    @property
    def accusations(self) -> dict[int, set[int]]:
        return self.membership.accusations if self.membership else {}

    @property
    def accused_since(self) -> float | None:
        return self.membership.accused_since if self.membership else None

    # -- setup ---------------------------------------------------------------------------
    def start(self) -> int:
        """Start the store and the liveness listener; return the store's port."""
        self.store = keys.serve_store(self.host, self.port)
        local = self.store.host  # the address it bound, numeric (loopback for every interface)
        self.client = CountedStore(keys.connect_store(local, self.store.port, 30.0),
                                   self.requests, "main")
        # Fixed ports follow the store's (liveness + 1, shards + 2...) only when the liveness
        # port is derived too; otherwise (a restarted coordinator: --liveness-port 0) any.
        fixed = self.liveness_port is None and self.port != 0
        want = self.liveness_port
        if want is None:
            want = self.port + 1 if self.port else 0
        try:
            lport = self.liveness_port = self.liveness.open(self.host, want)  # exactly --host
        except OSError as e:
            raise OSError(f"liveness port {want} (store port + 1 unless --liveness-port is "
                          f"given): {e.strerror or e}") from None
        for k in range(self.store_shards):
            want = self.port + 2 + k if fixed else 0
            self.shards.append(keys.serve_store(self.host, want))
        if self.shards:
            self.top = shards.TreeTop(self.client, self.shards, self.config.token)
        token = self.config.token
        # Sealed with the run's token (a stranger's rewrite is absent to a reader, and put back
        # by `_reassert`). A member reads only LIVENESS_ADDR (it needs it to say hello); the
        # rest reach it in its welcome (`Membership.params`) and stay here for tools.
        plain = {keys.COORD_STALE_S: repr(self.stale_s), keys.REPLICAS: str(self.expected),
                 keys.SHARDS: json.dumps([int(s.port) for s in self.shards]),
                 keys.LIVENESS_ADDR: f"{socket.gethostname()}:{lport}"}
        self._params = {k: sealed.seal(token, k, v.encode()) for k, v in plain.items()}
        # Not sealed: the launcher's fault injection reads the pid; `coord/run` is a proof.
        self._params |= {keys.COORD_PID: str(os.getpid()).encode(),
                         keys.RUN_PROOF: proof(token, keys.RUN_PURPOSE).encode()}
        self._params[keys.LIVENESS_ADDR] = self._params.pop(keys.LIVENESS_ADDR)  # written last
        for key, value in self._params.items():
            self.client.set(key, value)
        self._reasserted = time.monotonic()
        self.membership = Membership(self.config, self.client, self.liveness, self._log,
                                     started=time.monotonic())
        # A member takes these from its welcome (sealed by its session), not from the store.
        self.membership.shard_ports = [int(s.port) for s in self.shards]
        self.liveness.membership, self.liveness.top = self.membership, self.top
        self._log({"event": "start", "pid": os.getpid(), "port": self.store.port,
                   "liveness_port": lport,
                   "expected": self.expected,
                   "shard_ports": [int(s.port) for s in self.shards]})
        return int(self.store.port)

    def close(self) -> None:
        """After `serve` returned: close the liveness connections and listener, and let the
        store servers go (their connections close with them). For a coordinator that shares its
        process with others (tests); a `recover coordinator` process just exits."""
        self.liveness.close()
        self.membership = None
        self.client = self.store = None  # type: ignore[assignment]
        self.shards, self.top = [], None

    # -- main loop -----------------------------------------------------------------------
    def serve(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Run until `should_stop()`, or until every joined replica has left or been lost (with
        exit_when_done)."""
        m = self.membership
        assert m is not None, "start() first"
        last = time.monotonic()
        while not should_stop():
            now = time.monotonic()
            if now - last > STALL_S:
                # This loop itself was stalled (a store call, the machine): members could not
                # be heard meanwhile, so that time is not their silence.
                self.liveness.excuse(now - last)
            last = now
            # Sleep until an event or the next thing due (a silence check, a debounced
            # publication), not on a fixed 10 ms tick: idle turns cost the store server's cores.
            wait = HB_CHECK_S if m.generation >= 0 else 0.01
            if m.pending_since is not None:
                wait = min(wait, max(0.0, m.pending_since + DEBOUNCE_S - now))
            self.liveness.poll(wait)
            now = time.monotonic()
            self.liveness.drop_silent_strangers(now)
            if now - self._reasserted >= REASSERT_S:
                self._reassert(now)
            if now - self._pinged >= self.ping_s:
                self._pinged = now
                # The generation published last rides on the ping: a member that missed its
                # push (a full send buffer drops it) learns of it within a ping, and one that
                # hears pings needs no periodic store read for generations (control/member.py).
                self.liveness.send_all("ping\n" if m.published is None else
                                       f"ping {m.published}\n")
            if m.generation < 0:
                if m.first_generation(now):
                    self.liveness.heard_now(now)  # silence is judged from now on
            else:
                self._check_heartbeats(now)
                if m.publish_due(now):
                    m.publish_next()
                if m.everyone_left() and self.exit_when_done:
                    m.flush_exits(final=True)  # nobody is left to publish to
                    self.write_stats(now, force=True)
                    return 0
            self.write_stats(now)
        m.flush_exits(final=True)
        self.write_stats(time.monotonic(), force=True)
        return 0

    def _reassert(self, now: float) -> None:
        """Put back any of this coordinator's parameters that a stranger rewrote or deleted (one
        store request while none was): a member reads them once, when it starts, and waits
        (bounded) for an authentic one, so a rewrite costs a starting member at most
        REASSERT_S, never its start (DESIGN.md, "Trust")."""
        self._reasserted = now
        # The newest generations' members too: one rewritten after its publication stranded a
        # joiner that read it (every rebuild after failed) until the job's bound.
        want = {**self._params, **(self.membership.recent_members if self.membership else {})}
        names = list(want)
        try:
            held = self.client.multi_get(names) if self.client.check(names) else []
        except Exception as e:  # the store is this process's own: an error is logged, not fatal
            log.warning("could not read back the coordinator's parameters: %s", e)
            return
        wrong = [k for k, v in zip(names, held, strict=True) if v != want[k]] \
            if held else names
        for key in wrong:
            sealed.rejected(key, "rewritten by someone else; put back")
            self.client.set(key, want[key])

    def store_requests(self) -> int:
        """Requests of the main store so far: this process's, and every member's as its last
        heartbeat said (members that left keep their last figure)."""
        return self.requests.total("main") + self.liveness.requests()

    def write_stats(self, now: float, force: bool = False) -> None:
        """Rewrite `stats_path` (atomically: a reader sees the old figure or the new) when
        the figure changed, at most every STATS_S unless forced."""
        path = self.config.stats_path
        if path is None or (not force and now - self._stats[0] < STATS_S):
            return
        total = self.store_requests()
        if total != self._stats[1]:
            tmp = f"{path}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump({"time": round(time.time(), 4), "store_requests": total}, f)
                os.replace(tmp, path)
            except OSError as e:  # a full disk must not stop the membership; tried again later
                log.warning("cannot write %s: %s", path, e)
        self._stats = (now, total)

    def _check_heartbeats(self, now: float) -> None:
        """Tell the membership of silent connections (`LivenessListener.tell_silent`), and let
        it decide what time decides."""
        if now - self._hb_checked < HB_CHECK_S:
            return
        self._hb_checked = now
        m = self.membership
        assert m is not None
        self.liveness.tell_silent(now, self.stale_s)
        m.check_timeouts(now)


def raise_descriptor_limit() -> None:
    """Lift this process's soft limit on open files to the hard one: a coordinator holds a
    liveness connection per rank and the store's connections (three per rank)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)


def main(argv: list[str] | None = None) -> int:
    """`recover coordinator` / `python -m recover.control.coordinator`: run a coordinator
    until stopped (SIGTERM, SIGINT), or until every replica is done with --exit-when-done."""
    # Every bad flag, value or file ends here in one line and exit 2, before anything starts.
    ap: argparse.ArgumentParser = UsageParser(prog="recover coordinator")
    CoordinatorConfig.add_arguments(ap)
    try:
        config = CoordinatorConfig.from_args(ap.parse_args(argv))  # validated as it is built
        config.check_outputs()
        token = config.file_token() if config.token_file else LaunchEnv.from_env().token
        if not token and not config.no_token and not _loopback_only(config.host):
            raise ConfigError(
                f"--host {config.host} is reachable from other hosts and no token is set: give "
                "--token-file FILE (or RECOVER_RUN_TOKEN) and the same token to the workers, or "
                "--no-token to admit any process that reaches the ports")
    except RecoverError as e:
        return usage_line(ap.prog, e)
    config = dataclasses.replace(config, token=token)
    _log_to_stderr()
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__("flag", True))
    raise_descriptor_limit()
    coord = Coordinator(config)
    try:
        port = coord.start()
    except Exception as e:
        log.error("%scannot start on port %d: %s", LINE_PREFIX, config.port,
                  str(e).splitlines()[0])
        return int(ExitCode.USAGE)
    if config.port_file:
        tmp = Path(config.port_file + ".tmp")
        tmp.write_text(str(port))
        os.replace(tmp, config.port_file)
    log.info("%sstore on port %d, liveness on port %s", LINE_PREFIX, port, coord.liveness_port)
    return coord.serve(lambda: stop["flag"])


def _loopback_only(host: str) -> bool:
    """Whether `host` binds a loopback address only (a name is resolved as `listen` would; one
    that does not resolve is left to `start`, which names it)."""
    try:
        _, addr = listen.resolve(host, 0)
    except listen.ListenError:
        return True
    return netif.is_loopback(str(addr[0]))


def _log_to_stderr() -> None:
    """The process's own log, unless its parent set one up (a fork server's child inherits it)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=LaunchEnv.from_env().log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
