"""The cluster recipe (docs/cli.md) across real network hosts: one Linux network namespace per host.

The coordinator's host and each replica's host are network namespaces joined by a bridge that
lives in a namespace of its own, with addresses (10.77.0.x) that exist only inside them. The
commands are docs/cli.md's "On a cluster" lines, read from that page, with only the host, the run
directory and the data path substituted, and started as a user would: the coordinator first, then
one `torchrun` per replica once DIR/config.json exists. Faults are real: a replica's link cut at
the bridge (kept down, or brought back), or its worker SIGKILLed, a few steps into the run (all
three at once, in one run of four replicas: the fourth ends alone), and a cut between two
replicas' hosts that both still reach the coordinator.

Each run is judged on: a failure-free start across the hosts (generation 0, every replica live,
no data path off its host's address), the loss trajectory against the failure-free run (the
recipe's settings on one replica, in this host; 1e-5 relative at every step), N microbatches
on every metrics line, every surviving replica's exit code (0, its `torchrun`'s), the faulty
replica's own exit within 3 x --stale-s + 10 s of the fault, and the final checkpoint's label
against the AdamW step count it holds. Skipped, with the reason, where network namespaces are
unavailable (not root, no `ip`, or the kernel refuses). Every process is ended by its PID;
every namespace is deleted (and with it the bridge and the links).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness.processes import Proc, stop_all
from harness.runs import Run, max_rel, recover_train
from recover.app import rundir
from recover.collectives import FaultTolerantComm
from recover.control import GlooInterfaceError
from recover.control.netif import is_loopback
from recover.control.watchdog import ProgressWatch

README = Path(__file__).resolve().parent.parent / "docs" / "cli.md"  # the cluster recipe's page
SUBNET = "10.77.0"  # only ever assigned inside this test's own namespaces
FAULT_AFTER_STEPS = 4  # the fault lands once this many metrics lines are written
RUN_LIMIT_S = 300.0  # one whole run, startup included, on a loaded 2-core machine


# -- the recipe, from the README ---------------------------------------------------------------
def readme_recipe() -> tuple[list[str], list[str]]:
    """The coordinator's and the replica's command lines of docs/cli.md's cluster section."""
    section = README.read_text().split("## On a cluster", 1)[1].split("\n## ", 1)[0]
    lines: list[str] = []
    for raw in section.splitlines():
        if not raw.startswith("    ") or raw.strip().startswith("#"):
            continue
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + raw.strip()
        else:
            lines.append(raw.strip())
    coord = [shlex.split(c) for c in lines if c.startswith("recover train ")]
    worker = [shlex.split(c) for c in lines if c.startswith("torchrun ")]
    assert len(coord) == 1 and len(worker) == 1, f"docs/cli.md's cluster recipe changed: {lines}"
    return coord[0], worker[0]


COORD_CMD, WORKER_CMD = readme_recipe()


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


REPLICAS = int(flag(COORD_CMD, "--replicas"))
STEPS = int(flag(COORD_CMD, "--steps"))
STALE_S = float(flag(COORD_CMD, "--stale-s"))
EXIT_BOUND_S = 3 * STALE_S + 10  # the bound on a cut-off replica's exit


def substitute(cmd: list[str], subs: dict[str, str]) -> list[str]:
    """Replace each placeholder (which must occur) inside the command's words."""
    joined = "\0".join(cmd)
    for old, new in subs.items():
        assert old in joined, f"the README recipe no longer contains {old!r}: {cmd}"
        joined = joined.replace(old, new)
    return joined.split("\0")


# -- the network ---------------------------------------------------------------------------------
class NetUnavailable(Exception):
    """Network namespaces cannot be created here (a reason to skip, not a failure)."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Net:
    """Host 0 is the coordinator's (SUBNET.1), host i+1 is replica i's (SUBNET.i+2)."""

    def __init__(self, hosts: int) -> None:
        self.prefix = f"rmh{os.getpid() % 100000}x{time.monotonic_ns() % 1000}"
        self.hosts = hosts
        self.made: list[str] = []

    def ns(self, h: int) -> str:
        return f"{self.prefix}h{h}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def addr(self, h: int) -> str:
        return f"{SUBNET}.{h + 1}"

    def exec(self, h: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(h), *cmd]

    def cut_between(self, a: int, b: int, how: str) -> None:
        """Cut the data path between hosts a and b, both ways, while each still reaches every
        other host. "drop": each sends the other's packets to a MAC address nobody has (the
        bridge floods them, no NIC takes them): silent, as a failed switch port or a dropping
        firewall is (no iptables/nft here). "blackhole": a blackhole route each way: the
        kernel refuses the send at once (connect: EINVAL), which a real cut never does."""
        for src, dst in ((a, b), (b, a)):
            if how == "drop":
                _ip("-n", self.ns(src), "neigh", "replace", self.addr(dst), "lladdr",
                    "02:00:00:00:00:01", "dev", "eth0", "nud", "permanent")
            else:
                _ip("-n", self.ns(src), "route", "add", "blackhole", f"{self.addr(dst)}/32")

    def link(self, h: int, up: bool) -> None:
        """Cut (or restore) host h's cable at the bridge: its packets are dropped, no reset."""
        _ip("-n", self.switch, "link", "set", f"p{h}", "up" if up else "down")

    def create(self) -> None:
        try:
            _ip("netns", "add", self.switch)
        except RuntimeError as e:
            raise NetUnavailable(str(e)) from None
        self.made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in range(self.hosts):
            ns = self.ns(h)
            _ip("netns", "add", ns)
            self.made.append(ns)
            # Both ends are created inside namespaces: nothing is added to the host's own network.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{h}",
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{h}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{h}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def delete(self) -> None:
        for ns in reversed(self.made):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _ip("netns", "delete", ns)
        self.made.clear()


@contextlib.contextmanager
def network(hosts: int) -> Iterator[Net]:
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux-only")
    if os.geteuid() != 0:
        pytest.skip("network namespaces (ip netns) need root; not root here")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) for network namespaces")
    net = Net(hosts)
    try:
        try:
            net.create()
        except NetUnavailable as e:
            pytest.skip(f"cannot create a network namespace here: {e}")
        yield net
    finally:
        net.delete()


# -- one run of the recipe -----------------------------------------------------------------------
@dataclass
class Outcome:
    out: Path
    coordinator: Proc
    replicas: list[Proc]
    victims: tuple[int, ...] = ()
    t_fault: float | None = None
    cut: tuple[int, int] | None = None  # a "partition" fault's two replicas

    def metrics(self) -> list[dict]:
        with open(self.out / rundir.METRICS) as f:
            return [json.loads(line) for line in f if line.strip()]

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.metrics()]

    def events(self) -> list[dict]:
        with open(self.out / rundir.COORDINATOR_LOG) as f:
            return [json.loads(line) for line in f if line.strip()]

    def exits(self) -> dict[int, str]:
        raw = json.loads((self.out / rundir.REPLICA_EXITS).read_text())
        return {int(r): how for r, how in raw.items()}

    def diagnostics(self) -> str:
        parts = [f"{p.name}: rc={p.returncode}\n{p.stderr()[-2500:]}"
                 for p in [self.coordinator, *self.replicas]]
        return "\n".join(parts)


def _wait(cond: Callable[[], bool], limit_s: float, what: str, watch: Proc) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert watch.alive(), f"{watch.name} exited ({watch.returncode}) before {what}:\n" \
                              f"{watch.stderr()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s:.0f}s"
        time.sleep(0.02)


def _metrics_lines(out: Path) -> int:
    try:
        return (out / rundir.METRICS).read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _dropped(out: Path, replica: int) -> bool:
    """The coordinator has published a generation without `replica`."""
    with contextlib.suppress(FileNotFoundError):
        for line in (out / rundir.COORDINATOR_LOG).read_text().splitlines():
            e = json.loads(line)
            if e.get("event") == "generation" and replica not in e["members"]:
                return True
    return False


def _worker_pids(out: Path) -> dict[int, int]:
    """Each replica's worker PID (torchrun's child), from the coordinator's hello events."""
    pids: dict[int, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in (out / rundir.COORDINATOR_LOG).read_text().splitlines():
            e = json.loads(line)
            if e.get("event") == "hello":
                pids[int(e["replica"])] = int(e["pid"])
    return pids


def _end_worker(pid: int, out: Path) -> None:
    """SIGKILL a worker left behind (its torchrun was killed), if that PID is still it."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if str(out).encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def with_flags(cmd: list[str], flags: dict[str, str]) -> list[str]:
    """The command with each flag's value replaced (added if absent)."""
    cmd = list(cmd)
    for name, value in flags.items():
        if name in cmd:
            cmd[cmd.index(name) + 1] = value
        else:
            cmd += [name, value]
    return cmd


def run_recipe(tmp: Path, corpus: Path, faults: dict[int, str] | None = None,
               replicas: int = REPLICAS, stop_at: int | None = None) -> Outcome:
    """Run docs/cli.md's recipe on fresh hosts; `faults`: replica -> cut, cut-back or kill, or
    "partition PEER HOW" (the data path between the two replicas cut for good, both ways, HOW
    being `Net.cut_between`'s), all at the same moment. `replicas` and `stop_at` override the
    recipe's (--stop-at keeps the recipe's --steps, so its learning-rate schedule)."""
    faults = faults or {}
    coord_cmd = with_flags(COORD_CMD, {"--replicas": str(replicas),
                                       **({"--stop-at": str(stop_at)} if stop_at else {})})
    out, logs = tmp / "run1", tmp / "logs"
    logs.mkdir()
    # The commands are found on PATH as in a user's shell (the venv's `recover`, `torchrun`).
    env = {**os.environ,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    procs: list[Proc] = []
    with network(replicas + 1) as net:
        subs = {"/shared/run1": str(out)}
        try:
            cmd = substitute(coord_cmd, {**subs, "/shared/corpus.txt": str(corpus)})
            coord = Proc.command("coordinator", net.exec(0, cmd), logs, env)
            procs.append(coord)
            _wait(lambda: (out / rundir.CONFIG).exists(), RUN_LIMIT_S, "DIR/config.json", coord)
            for i in range(replicas):
                cmd = substitute(WORKER_CMD, {**subs, "COORD_HOST": net.addr(0), "$i": str(i)})
                procs.append(Proc.command(f"replica{i}", net.exec(i + 1, cmd), logs, env))
            o = Outcome(out, coord, procs[1:])
            if faults:
                _wait(lambda: _metrics_lines(out) >= FAULT_AFTER_STEPS, RUN_LIMIT_S,
                      f"{FAULT_AFTER_STEPS} metrics lines", coord)
                o.t_fault = time.time()
                o.victims = tuple(sorted(v for v, f in faults.items() if "partition" not in f))
                for victim, fault in faults.items():
                    if fault == "kill":
                        os.kill(_worker_pids(out)[victim], signal.SIGKILL)
                    elif fault.startswith("partition"):
                        _, peer, how = fault.split()
                        o.cut = (victim, int(peer))
                        net.cut_between(victim + 1, int(peer) + 1, how)
                    else:
                        net.link(victim + 1, up=False)
            deadline = time.monotonic() + RUN_LIMIT_S
            # "cut": the link stays down until the run is over
            down = [v for v, f in faults.items() if f == "cut-back"]
            # Poll every process each turn (not any(): it stops at the first one alive), so
            # each exit is timed when it happens.
            while any([p.alive() for p in procs]) and time.monotonic() < deadline:
                for victim in [v for v in down if _dropped(out, v)]:
                    net.link(victim + 1, up=True)
                    down.remove(victim)
                time.sleep(0.02)
            return o
        finally:
            stop_all(procs)
            for pid in _worker_pids(out).values():
                _end_worker(pid, out)


def adam_steps(ckpt: Path, tmp: Path) -> set[int]:
    """The AdamW step counts held by a DCP checkpoint (one per parameter; all equal)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = tmp / f"{ckpt.name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp_to_torch_save(ckpt, dst)
    state = torch.load(dst, weights_only=True)["optim"]["state"]
    return {int(s["step"]) for s in state.values()}


# -- the judgement -----------------------------------------------------------------------------
# What a replica logs when its data path did not cross the hosts (recover.control.netif).
FALLBACKS = ("reached over loopback", "could not connect from")


def check_before_fault(o: Outcome) -> None:
    """Until the fault, the run was a failure-free one across the hosts: every replica a member
    of generation 0 at every step, and no replica's data path fell back off its own address."""
    recs = o.metrics()[:FAULT_AFTER_STEPS]
    assert {r["live_replicas"] for r in recs} == {len(o.replicas)}, recs
    assert {r["generation"] for r in recs} == {0}, "membership changed before the fault"
    for p in o.replicas:
        assert not any(f in p.stderr() for f in FALLBACKS), p.stderr()[-2000:]


def check_run(o: Outcome, ref: Run, tmp: Path) -> None:
    why = o.diagnostics()
    assert o.coordinator.returncode == 0, f"the coordinator's `recover train` failed\n{why}"
    check_before_fault(o)
    n = json.loads((o.out / rundir.CONFIG).read_text())["data"]["microbatches"]
    recs = o.metrics()
    assert [r["step"] for r in recs] == list(range(STEPS)), why
    assert all(r["microbatches"] == n for r in recs), [r["microbatches"] for r in recs]
    assert max_rel(o.losses(), ref.losses()) <= 1e-5
    for i, p in enumerate(o.replicas):
        if i not in o.victims:
            assert p.returncode == 0, f"survivor {i}'s torchrun exited {p.returncode}\n{why}"
            assert "left cleanly" in o.exits()[i], o.exits()
    for victim in o.victims:
        assert o.t_fault is not None
        p = o.replicas[victim]
        assert p.returncode not in (0, None), f"replica {victim} did not fail\n{why}"
        assert p.exited_at is not None and p.exited_at - o.t_fault <= EXIT_BOUND_S, (
            f"replica {victim} exited {p.exited_at and p.exited_at - o.t_fault:.1f}s after the "
            f"fault (bound {EXIT_BOUND_S:.0f}s)\n{why}")
        # The fault landed mid-run: the run went on, and ended, without the victims.
        live = [r["live_replicas"] for r in recs]
        assert live[FAULT_AFTER_STEPS - 1] == len(o.replicas), live
        assert live[-1] == len(o.replicas) - len(o.victims), live
    ckpt = o.out / rundir.CKPT / (o.out / rundir.CKPT / "latest").read_text().strip()
    meta = json.loads(json.loads((ckpt / "meta.json").read_text())["manifest"])
    assert ckpt.name == f"step_{STEPS:08d}" and meta["step"] == STEPS, (ckpt, meta["step"])
    assert adam_steps(ckpt, tmp) == {STEPS}, f"{ckpt.name} holds {adam_steps(ckpt, tmp)} steps"


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The failure-free trajectory every faulty run must follow: the recipe's settings on one
    replica on this host (the trajectory is a function of (seed, data, N) alone:
    docs/DESIGN.md, "The invariant"). Every recipe run below is failure-free across the hosts
    until its fault lands, and is checked so (`check_before_fault`)."""
    run = recover_train(tmp_path_factory.mktemp("multihost-ref") / "run", "--steps", str(STEPS),
                        "--replicas", "1", data=corpus)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def three_faults(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """One run of four replicas, three fault families at the same step: the leader's cable cut
    for good, replica 1's worker SIGKILLed, replica 2's cable cut and brought back once it was
    dropped; replica 3 trains on alone (two recipe runs fewer than a run each; each fault is
    judged on its own)."""
    return run_recipe(tmp_path_factory.mktemp("multihost-faults"), corpus,
                      {0: "cut", 1: "kill", 2: "cut-back"}, replicas=4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_link_cut_and_kept_down(reference: Run, three_faults: Outcome,
                                tmp_path: Path) -> None:
    """The leader's cable is cut for good: it gives up by itself; the others go on and save."""
    o = three_faults
    check_run(o, reference, tmp_path)
    err = o.replicas[0].stderr()
    assert "heard nothing from the coordinator" in err, err[-2000:]
    assert o.exits()[0].startswith("coordinator: fenced"), o.exits()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_link_cut_and_brought_back(reference: Run, three_faults: Outcome,
                                   tmp_path: Path) -> None:
    """The cable comes back as soon as the coordinator has dropped the replica: it learns that
    it was dropped (or, if TCP's retransmission timer is slower than its silence bound, gives
    up on its own), and changes nothing: trajectory, checkpoint and membership are the others'."""
    o = three_faults
    check_run(o, reference, tmp_path)
    err = o.replicas[2].stderr()
    assert "fenced, exiting" in err or "heard nothing from the coordinator" in err, err[-2000:]
    gens = [e for e in o.events() if e["event"] == "generation"]
    dropped = next(i for i, e in enumerate(gens) if 2 not in e["members"])
    assert all(2 not in e["members"] for e in gens[dropped:]), gens
    assert not [e for e in o.events() if e["event"] == "rejected"], "it tried to rejoin"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill(reference: Run, three_faults: Outcome, tmp_path: Path) -> None:
    o = three_faults
    check_run(o, reference, tmp_path)
    assert o.exits()[1].startswith("coordinator: lost: connection closed"), o.exits()


# -- a cut between two replicas that both still reach the coordinator -----------------------------
CUT_STOP_AT = 8  # steps: the cut lands after FAULT_AFTER_STEPS, the rest run without one side
COMMIT_GAP_S = 3 * STALE_S + 5  # the bound on the pause a cut may cause


def check_cut(o: Outcome, ref: Run, replicas: int) -> None:
    """Exactly one side of the cut is evicted (fenced, and says why); the others train every
    step to the end with N microbatches, on the failure-free trajectory, without a long pause.
    The reference has another replica count: the trajectory is a function of (seed, data, N)
    alone (docs/DESIGN.md, "The invariant"); --stop-at keeps its --steps, so its schedule."""
    why = o.diagnostics()
    assert o.coordinator.returncode == 0, f"the coordinator's `recover train` failed\n{why}"
    check_before_fault(o)
    assert o.cut is not None
    n = json.loads((o.out / rundir.CONFIG).read_text())["data"]["microbatches"]
    recs = o.metrics()
    assert [r["step"] for r in recs] == list(range(CUT_STOP_AT)), why
    assert all(r["microbatches"] == n for r in recs), [r["microbatches"] for r in recs]
    assert max_rel(o.losses(), ref.losses()[:CUT_STOP_AT]) <= 1e-5
    times = [r["time_s"] for r in recs]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= COMMIT_GAP_S, f"commit gaps {gaps} (bound {COMMIT_GAP_S:.0f}s)\n{why}"
    exits = o.exits()
    evicted = [r for r in o.cut if not exits[r].endswith("left cleanly")]
    assert len(evicted) == 1, f"exactly one side of the cut {o.cut} goes: {exits}"
    gone, kept = evicted[0], sum(o.cut) - evicted[0]
    assert exits[gone].startswith(f"coordinator: fenced: unreachable from replica {kept} over "
                                  "the data path"), exits
    assert o.replicas[gone].returncode not in (0, None), why
    for i, p in enumerate(o.replicas):
        if i != gone:
            assert p.returncode == 0 and exits[i].endswith("left cleanly"), (i, exits, why)
    live = [r["live_replicas"] for r in recs]
    assert live[FAULT_AFTER_STEPS - 1] == replicas and live[-1] == replicas - 1, live


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cut_between_two_of_four_replicas_evicts_one_side(
        reference: Run, corpus: Path, tmp_path: Path) -> None:
    """Replicas 1 and 3 lose each other for good (silently: packets dropped, as a failed link
    does) while all four reach the coordinator: one of them is evicted on the evidence. The
    debug gradient goes up and down a binary tree (collectives/tree.py), in which 3 is 1's
    child; a cut between two that exchange nothing in it (2 and 3) goes unnoticed until a
    rebuild's full mesh needs that pair."""
    o = run_recipe(tmp_path, corpus, {1: "partition 3 drop"}, replicas=4, stop_at=CUT_STOP_AT)
    check_cut(o, reference, 4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cut_between_the_only_two_replicas_evicts_one(
        reference: Run, corpus: Path, tmp_path: Path) -> None:
    """Two replicas, each naming the other: the first to report stays (a blackhole route this
    time: the kernel refuses at once, the other way a cut shows)."""
    o = run_recipe(tmp_path, corpus, {0: "partition 1 blackhole"}, replicas=2,
                   stop_at=CUT_STOP_AT)
    check_cut(o, reference, 2)


# -- the interface choice, without processes ---------------------------------------------------
class _Member:
    """What FaultTolerantComm reads of a Member: replica 1 of [0, 1], joined from `local_addr`."""

    def __init__(self, store: object, local_addr: str, coordinator_remote: bool) -> None:
        self.store = self.plain_store = store
        self.local_addr = local_addr
        self.coordinator_remote = coordinator_remote
        self.replica, self.host, self.fenced = 1, f"{SUBNET}.1", False
        self.failed: list[int] = []
        self.watch = ProgressWatch()

    def generation(self) -> int:
        return 0

    def members(self, generation: int | None = None) -> list[int]:
        return [0, 1]

    def check(self) -> None:
        pass

    def report_fail(self, generation: int, suspects: tuple[int, ...] = ()) -> None:
        self.failed.append(generation)

    def notify_on_change(self, event: object, on: bool = True) -> None:
        pass


@pytest.fixture
def store() -> object:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)


def test_named_loopback_is_refused_when_the_coordinator_is_remote(store: object) -> None:
    comm = FaultTolerantComm(_Member(store, f"{SUBNET}.3", True), ifname="lo")  # type: ignore[arg-type]
    with pytest.raises(GlooInterfaceError, match=r"127\.0\.0\.1 \(lo\).*--gloo-ifname"):
        comm.reduce_([torch.zeros(1)], 0)


def test_unknown_interface_is_refused(store: object) -> None:
    comm = FaultTolerantComm(_Member(store, "127.0.0.1", False), ifname="nosuch9")  # type: ignore[arg-type]
    with pytest.raises(GlooInterfaceError, match="no network interface named 'nosuch9'"):
        comm.reduce_([torch.zeros(1)], 0)


def test_loopback_addresses() -> None:
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1"))
    assert not any(is_loopback(a) for a in (f"{SUBNET}.2", "::ffff:10.0.0.1", "vm", ""))
    # Its fast path for dotted IPv4 agrees with ipaddress's parse, malformed octets included.
    for a in ("127.0.0.256", "127.0.0.01", "127.0.0", "127.0.0.1.1", "127.0.0.1 ", "127.a.0.1",
              "127.0.0.\u00b2", "127.255.255.255", "127.0.0.1%lo", "128.0.0.1"):
        try:
            ip = ipaddress.ip_address(a.split("%", 1)[0])
            want = ip.is_loopback
        except ValueError:
            want = False
        assert is_loopback(a) == want, a
