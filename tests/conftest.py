"""Shared fixtures: small generated corpora (tests never depend on the corpus package)."""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock

sys.path.insert(0, str(Path(__file__).parent))
# The test harness lives in bench/harness (the benchmarks use it too), not in the installed tree.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
# Every TCPStore connection makes torch look up the peer's name ([::ffff:127.0.0.1], which
# /etc/hosts does not list). Where the DNS server drops some queries (seen: about 1 in 25 on
# the sandboxes this suite runs on), each such lookup stalls for glibc's default 5 s timeout;
# cap it at 1 s, for this process and every process the tests start.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

from harness.processes import close_session, session  # noqa: E402
from harness.runs import BASE, LAYOUT_ARGS, Run, recover_train  # noqa: E402

WORDS = (
    "the of and to in is that it was for on are with as his they be at one have this from or had "
    "by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find"
).split()


def generated_text(n_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_bytes:
        sent = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + ". "
        out.append(sent)
        size += len(sent)
        if rng.random() < 0.1:
            out.append("\n")
    return "".join(out)[:n_bytes]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long multi-process tests (marked `slow`) first: two workers then end together on the
    short ones, not one waiting for the other's last long run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~200 KB of generated English-like text."""
    p = tmp_path_factory.mktemp("corpus") / "text.txt"
    p.write_text(generated_text(200_000))
    return p


SHARED_LIMIT_S = 600  # a shared run's maker has this long (its own test timeout is shorter)


def shared_run(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Run]) -> Run:
    """A session run made once for the whole test session: under pytest-xdist every worker is
    a process with its own session fixtures, so the first to ask makes the run (under a file
    lock in the workers' common temporary directory) and the others read it; the runs are
    read-only references. A failed run is not shared: each asker sees its own failure."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(factory.mktemp(name) / "run")
    root = factory.getbasetemp().parent / name
    with FileLock(f"{root}.lock", timeout=SHARED_LIMIT_S):
        done = root / "done.json"
        if done.exists():
            return Run(**{**json.loads(done.read_text()), "out": root / "run"})
        root.mkdir(exist_ok=True)
        run = make(root / "run")
        if run.returncode == 0:
            done.write_text(json.dumps({"returncode": run.returncode, "stdout": run.stdout,
                                        "stderr": run.stderr}))
        return run


@pytest.fixture(scope="session")
def ref4(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The failure-free R=4, N=8 run (harness.runs.BASE) that many tests compare against."""
    run = shared_run(tmp_path_factory, "ref4", lambda out: recover_train(
        out, *BASE, "--replicas", "4", "--dump-final-params", data=corpus))
    assert run.returncode == 0, run.stderr[-3000:]
    return run


# Two failure-free exact-mode runs of one config (R=5, N=7: N not divisible by R): a bitwise pair
# for tests/test_repeatable.py, and a reference for tests/test_verify.py.
EXACT_PAIR_ARGS = ["--preset", "debug", "--eval-every", "0", "--dump-final-params", "--replicas",
                   "5", "--microbatches", "7", "--steps", "12", "--exact"]


@pytest.fixture(scope="session")
def exact_pair(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    runs = tuple(shared_run(tmp_path_factory, f"exact-{k}", lambda out: recover_train(
        out, *EXACT_PAIR_ARGS, data=corpus, timeout=200)) for k in "ab")
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    return runs  # type: ignore[return-value]


@pytest.fixture(scope="session")
def single_replica(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One plain replica computes all N microbatches (LAYOUT_ARGS): every multi-rank layout, with
    or without faults and resumes, must follow its trajectory."""
    run = shared_run(tmp_path_factory, "single", lambda out: recover_train(
        out, *LAYOUT_ARGS, "--dump-final-params", "--replicas", "1", data=corpus))
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(autouse=True)
def _root_logging() -> Iterator[None]:
    """Put the root logger back as it was after each test: a test that runs `recover`'s entry
    point in this process configures logging (`recover.app.logs.setup`) with the stream pytest
    captured for that test, which pytest closes after it; a thread a later test leaves running
    (a coordinator's) would log into that closed stream."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    # Only the plain stream handlers the test added: pytest adds and removes its own per phase.
    for h in [h for h in root.handlers if h not in before and type(h) is logging.StreamHandler]:
        root.removeHandler(h)
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def _session_fork_server() -> Iterator[None]:
    """Start the session's spawner (harness.processes) first, so that this process's one
    fork server imports its preload (a launcher forked from it then forks its own server from
    itself instead of starting a fresh interpreter: recover.procs); end what it started, by PID,
    once the last test is done."""
    session().warm()
    yield
    close_session()
