"""A loop of the user's own on `recover.Replica` keeps the invariant without rebuilding the app.

The workers are this file run as a script (`--worker`): one real process per replica, a plain
loop as a user ports it from DDP (a model with dropout, `IdBatches` over a map-style dataset, no
seeding of their own, nothing of `recover.app`), beside a real `recover coordinator`. Their
losses and final parameters are compared with the failure-free trajectory computed here in one
process (each microbatch on the RNG of its id, the step's gradient the sum over its N ids / N),
within DESIGN.md's fp32 tolerances: loss relative 1e-5, parameters relative L2 1e-4.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

STEPS, N, ROWS, SEED = 8, 7, 4, 0
AMP_INF_ID = 3  # with a GradScaler: this microbatch's loss is inf (step 0 is skipped)
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4


def _model(hidden: int = 32, init_seed: int = 0):  # noqa: ANN202 - torch is imported lazily
    import torch
    from torch import nn

    torch.manual_seed(init_seed)  # every replica builds the same initial weights
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(0.5), nn.Linear(hidden, 1))


def _dataset():  # noqa: ANN202
    import torch

    g = torch.Generator().manual_seed(123)
    x = torch.randn(96, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).tanh())


def _worker(argv: list[str]) -> int:
    import torch

    from recover import Replica
    from recover.data import IdBatches
    from recover.settings import FaultTolerance, ReplicaConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=N)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--init-seed", type=int, default=0)
    ap.add_argument("--kill-at", type=int, default=-1)  # SIGKILL itself in this step's compute
    ap.add_argument("--term-at", type=int, default=-1)  # SIGTERM itself after this step
    ap.add_argument("--pause-at", type=int, default=-1)  # mark, then sleep (coordinator restart)
    ap.add_argument("--hold-at", type=int, default=-1)  # the same inside this step's compute
    ap.add_argument("--coordinator-wait-s", type=float, default=None)  # None: the library's
    ap.add_argument("--connect-timeout-s", type=float, default=30.0)
    ap.add_argument("--no-id-rng", action="store_true")  # the opt-out (issue 51's finding)
    ap.add_argument("--init", default="check")
    ap.add_argument("--step-sleep", type=float, default=0.0)  # a longer run: time to join it
    ap.add_argument("--amp-scale", type=float, default=0.0)  # > 0: a GradScaler from this scale
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = _model(a.hidden, a.init_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = IdBatches(_dataset(), ROWS, SEED)
    waits = ({} if a.coordinator_wait_s is None else
             {"coordinator_wait_s": a.coordinator_wait_s})  # None: the default
    config = ReplicaConfig(coordinator=f"127.0.0.1:{a.port}", replica=a.replica,
                           connect_timeout_s=a.connect_timeout_s, id_rng=not a.no_id_rng,
                           init=a.init,
                           ft=FaultTolerance(heartbeat_s=0.1, join_timeout_s=60.0,
                                             reduce_timeout_s=30.0, **waits))
    scaler = torch.amp.GradScaler("cpu", init_scale=a.amp_scale or 1.0, enabled=a.amp_scale > 0)
    rep = Replica(model, a.n, optimizer=opt, config=config, data=data, state={"scaler": scaler})
    losses: dict[int, float] = {}

    def compute(mb_id: int, j: int) -> float:
        if a.kill_at == step and j == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, mid-microbatches
        held = a.out / f"held{a.replica}"
        if a.hold_at == step and not held.exists():  # once: not when the step runs again
            held.write_text("")
            time.sleep(2.0)  # inside the step: the test kills the coordinator meanwhile
        x, y = data.batch(mb_id)
        loss = torch.nn.functional.mse_loss(model(x), y)  # dropout: unseeded by this loop
        if scaler.is_enabled() and mb_id == AMP_INF_ID:
            loss = loss * float("inf")  # one microbatch overflows, as in fp16
        scaler.scale(loss / a.n).backward()
        return loss.item()

    model.train()
    step = rep.start_step
    while step < STEPS:
        if step == a.pause_at:
            (a.out / f"paused{a.replica}").write_text("")
            time.sleep(1.5)  # the test kills the coordinator meanwhile
        time.sleep(a.step_sleep)
        losses[step] = rep.step(step, compute).loss
        scaler.step(opt)  # skipped alike on every replica: they all hold the same reduced sum
        scaler.update()
        opt.zero_grad()
        (a.out / f"losses{a.replica}.json").write_text(json.dumps(losses))
        (a.out / f"scale{a.replica}").write_text(repr(scaler.get_scale()))
        if step == a.term_at:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, between two steps
        step += 1
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               a.out / f"final{a.replica}.pt")
    rep.leave()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.exit(_worker(sys.argv[2:]))


pytestmark = pytest.mark.timeout(90)


def _reference(amp_scale: float = 0.0) -> tuple[list[float], dict]:
    """The failure-free trajectory in one process: each id on its own RNG (the app's stream);
    with `amp_scale`, through a GradScaler and microbatch AMP_INF_ID's loss inf."""
    import torch

    from recover.data import IdBatches
    from recover.replica.invariant import DROPOUT_STREAM
    from recover.workload import id_seed

    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = IdBatches(_dataset(), ROWS, SEED)
    scaler = torch.amp.GradScaler("cpu", init_scale=amp_scale or 1.0, enabled=amp_scale > 0)
    model.train()
    losses = []
    for step in range(STEPS):
        total = 0.0
        for mb_id in range(step * N, step * N + N):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(id_seed(SEED, mb_id, stream=DROPOUT_STREAM))
                x, y = data.batch(mb_id)
                loss = torch.nn.functional.mse_loss(model(x), y)
                if amp_scale and mb_id == AMP_INF_ID:
                    loss = loss * float("inf")
                scaler.scale(loss / N).backward()
            total += loss.item()
        losses.append(total / N)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent.parent / "src"), os.environ.get("PYTHONPATH", "")])}


def _worker_cmd(out: Path, r: int, *flags: str) -> list[str]:
    return [sys.executable, __file__, "--worker", "--replica", str(r), "--out", str(out), *flags]


def _coordinator(out: Path, replicas: int, port: int, *flags: str,
                 exit_when_done: bool = True):  # noqa: ANN202
    from recover import procs

    return procs.start([sys.executable, "-m", "recover", "coordinator", "--replicas",
                        str(replicas), "--port", str(port), "--liveness-port", str(port + 1),
                        "--host", "127.0.0.1", "--stale-s", "5",
                        *(["--exit-when-done"] if exit_when_done else []),
                        "--log", str(out / "coordinator.jsonl"), *flags],
                       out / "coordinator.out", env={**_env(), "RECOVER_RUN_TOKEN": "t0k"})


def _start(out: Path, r: int, port: int, *flags: str):  # noqa: ANN202
    from recover import procs

    return procs.start([*_worker_cmd(out, r, *flags), "--port", str(port)],
                       out / f"worker{r}.out", env={**_env(), "RECOVER_RUN_TOKEN": "t0k"})


def _check_trajectory(out: Path, replica: int, first: int = 0, amp_scale: float = 0.0) -> None:
    """The replica's losses from step `first` on, and its final parameters, are the
    failure-free run's."""
    import math

    import torch

    from harness.runs import max_rel, rel_l2

    ref_losses, ref_final = _reference(amp_scale)
    got = json.loads((out / f"losses{replica}.json").read_text())
    assert sorted(map(int, got)) == list(range(first, STEPS))
    steps = [s for s in range(first, STEPS) if math.isfinite(ref_losses[s])]
    assert all(math.isinf(got[str(s)]) for s in range(first, STEPS) if s not in steps)
    assert max_rel([got[str(s)] for s in steps], [ref_losses[s] for s in steps]) < LOSS_TOL
    assert rel_l2(torch.load(out / f"final{replica}.pt"), ref_final) < PARAM_TOL


def _wait_key(port: int, key: str, proc) -> None:  # noqa: ANN001
    """Until `key` is in the coordinator's store (`proc` must not exit meanwhile)."""
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=30))
    deadline = time.monotonic() + 45
    while not store.check([key]):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)


def _wait_all(procs_: list, out: Path, timeout_s: float) -> list[int | None]:
    from recover import procs

    deadline = time.monotonic() + timeout_s
    return [procs.wait_exit(p, deadline - time.monotonic()) for p in procs_]


def test_dropout_without_user_seeding_keeps_the_trajectory_through_a_kill_and_a_sigterm(
        tmp_path: Path) -> None:
    """3 replicas, N=7, dropout on, the loop seeds nothing: replica 2 is SIGKILLed mid-step 3,
    replica 1 gets SIGTERM after step 5 (a planned leave: exit 0, at the step boundary); replica
    0 ends on the failure-free trajectory. Without the library's per-id RNG the same run ends
    ~1e-3 off (measured: the finding of issue 51)."""
    from harness.runs import free_ports
    from recover import procs

    port = free_ports(2)
    coord = _coordinator(tmp_path, 3, port)
    workers = [_start(tmp_path, 0, port), _start(tmp_path, 1, port, "--term-at", "5"),
               _start(tmp_path, 2, port, "--kill-at", "3")]
    try:
        codes = _wait_all(workers, tmp_path, 75.0)
        logs = [(tmp_path / f"worker{r}.out").read_text() for r in range(3)]
        assert codes == [0, 0, -signal.SIGKILL], (codes, [t[-2000:] for t in logs])
        assert "leaves the run at the step boundary before step 6" in logs[1], logs[1][-2000:]
        assert sorted(map(int, json.loads((tmp_path / "losses1.json").read_text()))) == \
            list(range(6))  # it left after step 5: it computed nothing of step 6
        _check_trajectory(tmp_path, 0)
    finally:
        procs.stop_all([*workers, coord])


@pytest.mark.slow
def test_another_run_is_refused_at_join_in_one_line_naming_the_field(tmp_path: Path) -> None:
    """With replica 0 joined, a replica with another N, another model or other initial weights
    is refused before its hello, in one line naming what differs, exit 1, no traceback; and a
    coordinator that is not there is one line naming its address within the connect timeout."""
    from harness.runs import free_ports
    from recover import procs
    from recover.settings import ReplicaConfig

    assert ReplicaConfig().connect_timeout_s <= 30.0
    port = free_ports(2)
    coord = _coordinator(tmp_path, 2, port)
    first = _start(tmp_path, 0, port)
    started: list = []
    try:
        _wait_key(port, "own/init/pos0", first)
        cases = {("--n", "5"): "N (microbatches per step) is 5 here, 7 in the run",
                 ("--hidden", "16"): "parameter '0.weight' has shape [16, 8] here, [32, 8]",
                 ("--init-seed", "1"): "initial model state differs from the run's first "
                                       "replica at '0.weight'"}
        for k, flags in enumerate(cases):  # at once: each is refused before its hello
            (tmp_path / f"case{k}").mkdir()
            started.append(_start(tmp_path / f"case{k}", 1, port, *flags))
        for k, expected in enumerate(cases.values()):
            assert procs.wait_exit(started[k], 40.0) == 1
            text = (tmp_path / f"case{k}" / "worker1.out").read_text()
            assert "Traceback" not in text and text.strip().count("\n") == 0, text[-2000:]
            assert text.startswith("recover: error: replica 1 rank 0 is refused: ") \
                and expected in text, text
        assert first.poll() is None  # the run's own replica is untouched
        # Nothing at an address: one line naming it, within the (short) connect timeout.
        dead = free_ports(1)
        out = tmp_path / "nobody"
        out.mkdir()
        t0 = time.monotonic()
        started.append(p := _start(out, 0, dead, "--connect-timeout-s", "2"))
        assert procs.wait_exit(p, 30.0) == 1
        text = (out / "worker0.out").read_text()
        assert time.monotonic() - t0 < 25.0
        assert text.strip() == (f"recover: error: cannot reach the recover coordinator at "
                                f"127.0.0.1:{dead} within 2s (nothing accepts connections "
                                "there): start `recover coordinator --replicas R --port P` "
                                "first, or fix RECOVER_COORDINATOR"), text[-2000:]
    finally:
        procs.stop_all([*started, first, coord])


def test_id_rng_is_a_function_of_the_id_and_puts_the_callers_rng_back() -> None:
    import torch

    from recover.replica.invariant import id_rng

    def mask(mb_id: int) -> torch.Tensor:
        with id_rng(SEED, mb_id, []):
            return torch.nn.functional.dropout(torch.ones(64), 0.5)

    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = mask(3)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream never moved
    torch.rand(10)  # another history: the id alone decides
    assert torch.equal(mask(3), a) and not torch.equal(mask(4), a)
    with pytest.raises(ValueError), id_rng(SEED, 3, []):
        torch.rand(3)
        raise ValueError
    torch.manual_seed(5)
    assert torch.equal(torch.get_rng_state(), before)


class _Store:
    """compare_set and add as TCPStore does them, in memory."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, desired: bytes | str) -> bytes:
        desired = desired.encode() if isinstance(desired, str) else desired
        if key not in self.kv:
            if expected == "":
                self.kv[key] = desired
                return desired
            return expected.encode()
        if self.kv[key] == expected.encode():
            self.kv[key] = desired
        return self.kv[key]

    def add(self, key: str, n: int) -> int:
        self.kv[key] = str(int(self.kv.get(key, b"0")) + n).encode()
        return int(self.kv[key])


def test_check_join_names_the_first_difference_and_ignores_a_forged_value() -> None:
    from recover.replica import invariant

    store, token = _Store(), "secret"
    run = invariant.identity(_model(), N, SEED, "-")
    invariant.check_join(store, token, 0, 0, run, _model())  # the first: defines the run
    invariant.check_join(store, token, 0, 1, run, _model())  # the same run: accepted
    with pytest.raises(invariant.JoinRefused, match=r"seed \(ReplicaConfig.seed\) is 1 here"):
        invariant.check_join(store, token, 0, 1, invariant.identity(_model(), N, 1, "-"), None)
    with pytest.raises(invariant.JoinRefused, match="differs from the run's first replica at "
                                                    "'0.weight'"):
        invariant.check_join(store, token, 0, 1, run, _model(init_seed=1))
    store.add("gen/count", 1)  # the run started: a joiner's weights come by transfer
    invariant.check_join(store, token, 0, 1, run, _model(init_seed=1))
    # A value written without the token decides nothing (logged, ignored).
    forged = _Store()
    forged.kv["own/identity/pos0"] = b'{"microbatches": 99}'
    invariant.check_join(forged, token, 0, 1, run, _model())
    # Without a token values are bare: one that is no identity (nor digest list) is ignored too.
    bare = _Store()
    bare.kv.update({"own/identity/pos0": b'{"params": 5}', "own/init/pos0": b'{"a": 1}'})
    assert invariant.check_join(bare, None, 0, 1, run, _model()) is False


@pytest.mark.slow
def test_other_initial_weights_are_adopted_from_a_running_replica(tmp_path: Path) -> None:
    """`init="adopt"`: replica 1 builds other initial weights; it leaves the first generation,
    receives replica 0's state by the authenticated transfer, and ends on the trajectory of
    replica 0's weights (DDP's broadcast at wrap time, without a collective of its own). Both
    train through a GradScaler (CPU) whose step 0 overflows in one microbatch: skipped by every
    replica alike, and the scaler's state (another initial scale on replica 1) travels with the
    rest to the joiner (`Replica(..., state={"scaler": scaler})`)."""
    from harness.runs import free_ports
    from recover import procs

    port = free_ports(2)
    coord = _coordinator(tmp_path, 2, port)
    workers = [_start(tmp_path, 0, port, "--step-sleep", "0.25", "--amp-scale", "65536")]
    try:
        _wait_key(port, "own/init/pos0", workers[0])  # replica 0's weights are the run's
        workers.append(_start(tmp_path, 1, port, "--init-seed", "1", "--init", "adopt",
                              "--step-sleep", "0.25", "--amp-scale", "1024"))
        codes = _wait_all(workers, tmp_path, 75.0)
        logs = [(tmp_path / f"worker{r}.out").read_text() for r in range(2)]
        assert codes == [0, 0], (codes, [t[-2000:] for t in logs])
        assert "takes a running replica's (init='adopt')" in logs[1], logs[1][-2000:]
        _check_trajectory(tmp_path, 0, amp_scale=65536)
        first = min(map(int, json.loads((tmp_path / "losses1.json").read_text())))
        _check_trajectory(tmp_path, 1, first, amp_scale=65536)  # from the step it received
        # The scaler's state came with the rest (1024 would have grown apart): one scale.
        assert (tmp_path / "scale0").read_text() == (tmp_path / "scale1").read_text() \
            == repr(65536.0 / 2)  # step 0's inf: skipped by all, the scale backed off once
    finally:
        procs.stop_all([*workers, coord])


def test_the_coordinator_killed_mid_step_is_rejoined_and_the_step_runs_again(
        tmp_path: Path) -> None:
    """The coordinator is SIGKILLed while both replicas are inside step 4's compute (not between
    steps), and restarted with `--recover`: with the default `coordinator_wait_s` (no setting in
    the loop) each `rep.step` keeps its state, rejoins by itself and runs step 4 again; both end
    on the failure-free trajectory."""
    from harness.runs import free_ports
    from recover import procs
    from recover.settings import FaultTolerance

    assert FaultTolerance().coordinator_wait_s == 60.0  # the default: the app's, rejoin by itself
    port = free_ports(2)
    coord = _coordinator(tmp_path, 2, port)
    flags = ("--hold-at", "4")  # the default coordinator_wait_s: no setting in the loop
    workers = [_start(tmp_path, r, port, *flags) for r in range(2)]
    second = None
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"held{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, [p.poll() for p in workers]
            time.sleep(0.02)
        losses = [json.loads((tmp_path / f"losses{r}.json").read_text()) for r in range(2)]
        assert [sorted(map(int, x)) for x in losses] == [list(range(4))] * 2  # in step 4
        procs.stop(coord, sig=signal.SIGKILL)
        second = _coordinator(tmp_path, 2, port, "--recover")
        codes = _wait_all(workers, tmp_path, 70.0)
        logs = [(tmp_path / f"worker{r}.out").read_text() for r in range(2)]
        assert codes == [0, 0], (codes, [t[-2000:] for t in logs])
        assert all("keeping the state of step 4 and waiting up to 60s" in t for t in logs), \
            [t[-2000:] for t in logs]
        for r in range(2):
            _check_trajectory(tmp_path, r)
    finally:
        procs.stop_all([*workers, coord, *([second] if second else [])])


def test_a_replica_started_after_the_run_ended_says_so_in_one_line_and_exits_0(
        tmp_path: Path) -> None:
    """A replica whose run finished before it was admitted (the coordinator, without
    `--exit-when-done`, is still up) ends with one line and exit code 0, not a traceback: the
    same as `recover train`'s worker (`RunOver`)."""
    from harness.runs import free_ports
    from recover import procs

    port = free_ports(2)
    coord = _coordinator(tmp_path, 1, port, exit_when_done=False)
    late = None
    first = _start(tmp_path, 0, port)
    try:
        assert procs.wait_exit(first, 60.0) == 0, (tmp_path / "worker0.out").read_text()[-2000:]
        log = tmp_path / "coordinator.jsonl"
        deadline = time.monotonic() + 30
        while '"all-left"' not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and coord.poll() is None
            time.sleep(0.05)
        (out := tmp_path / "late").mkdir()
        late = _start(out, 0, port)
        assert procs.wait_exit(late, 40.0) == 0, (out / "worker0.out").read_text()[-2000:]
        text = (out / "worker0.out").read_text()
        assert "Traceback" not in text and text.strip().count("\n") == 0, text[-2000:]
        assert text.strip() == ("recover: replica 0: the run ended before it was admitted: "
                                "nothing to do, exiting"), text
    finally:
        procs.stop_all([first, *([late] if late else []), coord])
