"""Every flag of `recover train`, `recover coordinator` and the worker, given wrong values.

The property: a wrong value (NaN, an infinity, 0 or a negative where the flag's declared bounds
exclude it, a huge number, text where a number goes, an empty or blank string) ends the entry
point with exit code 2 and exactly one line on stderr, `<prog>: error: ...`: never a traceback,
never a run that starts (the launcher, the coordinator or the training loop is replaced by a
sentinel that fails the test if reached, and nothing is created in the run directory).

The flags come from the parsers themselves (argparse's actions), so a new flag is fuzzed
without editing this file; numeric flags carry their bounds (`recover.settings.Number`), which
say where 0 is a legitimate value. A flag that legitimately takes any non-blank string is listed
in ANY_STRING with the reason; it is still fuzzed with blank values. Each entry point is called
in-process (`main(argv)`), with hypothesis choosing the values; one `given` per flag.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from recover.app import cli, rundir
from recover.app.config import preset
from recover.app.train import worker
from recover.control import coordinator
from recover.control.coordconfig import CoordinatorConfig
from recover.settings import Number

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

# Flags whose every non-blank value is legitimate, and why.
ANY_STRING = {
    "--out": "any path names a run directory to make (a file in its place, or a place no folder "
             "can be made: tests/test_cli_errors.py)",
    "--host": "any name may be a host: it is resolved when the listener binds "
              "(recover.control.listen refuses one that does not resolve, in one line)",
    "--fingerprint": "any word is a fingerprint (whitespace is refused: fuzzed)",
    "--port-file": "any path whose folder exists names a file for the coordinator to write",
    "--log": "any path whose folder exists names a file for the coordinator to write",
    "--stats-file": "any path whose folder exists names a file for the coordinator to write",
    "--tensorboard": "any path names a folder for the event files (none, auto: words it knows)",
    "--wandb": "any word of up to 128 characters without / \\ # ? % : is a W&B project "
               "(wandb's own rule, checked: tests/test_progress.py)",
}
BLANK = ("", " ", "\t")

# Always wrong, for every flag: not a finite number, huge, text where a number goes, blank.
ALWAYS_WRONG = st.one_of(
    st.sampled_from(["nan", "-nan", "NaN", "inf", "-inf", "Infinity", *BLANK]),
    st.integers(min_value=2 ** 64).map(str),  # past every bound (seeds are 63 bits)
    st.floats(min_value=1e20, allow_infinity=False).map(repr),  # huge, spelled as a float
    st.text(alphabet="abxyz!?%#", min_size=1, max_size=8).filter(
        lambda t: any(c in "!?%#" for c in t)),  # no number, no path, no name, no interface
)
# Wrong unless the flag's bounds take them (0: any port, never checkpoint, no shards...).
ZERO_OR_NEGATIVE = st.one_of(
    st.sampled_from(["0", "-0.0", "-1"]),
    st.integers(max_value=-1).map(str),
    st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False).map(repr),
)
WRONG = st.one_of(ALWAYS_WRONG.map(lambda v: (True, v)), ZERO_OR_NEGATIVE.map(lambda v: (False, v)))


class Started(Exception):
    """Raised by a sentinel standing in for whatever would start a run."""


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a.choices, dict))
    return sub.choices["train"]


def _coordinator_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    CoordinatorConfig.add_arguments(ap)
    return ap


def _name(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _wrong(data: st.DataObject, action: argparse.Action) -> str:
    """A wrong value for `action`, drawn by hypothesis: a blank one for a flag in ANY_STRING."""
    if _name(action) in ANY_STRING:
        return data.draw(st.sampled_from(BLANK))
    always_wrong, value = data.draw(WRONG)
    assume(always_wrong or not _legitimate(action, value))
    return value


def _legitimate(action: argparse.Action, value: str) -> bool:
    """Whether a 0 or negative `value` may be right for `action`: its bounds take it."""
    if not isinstance(action.type, Number):
        return False
    try:
        x = action.type(value)
    except ValueError:
        return False
    return math.isfinite(x) and action.type.bounds.contains(x)


def _argv(action: argparse.Action, value: str) -> list[str]:
    """The flag with the value (`--flag=value`, so a value that starts with `-` stays a value);
    a switch with a value it does not take."""
    return [_name(action), value] if action.nargs == 0 else [f"{_name(action)}={value}"]


def _one_error_line(capsys: pytest.CaptureFixture[str], call: Callable[[], object],
                    prog: str) -> str:
    try:
        code = call()
    except SystemExit as e:  # argparse's own errors (recover.errors.UsageParser)
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    # `recover: error: unrecognized arguments: x` comes from the top-level parser: still one line.
    assert len(lines) == 1 and lines[0].startswith(prog.split()[0]), err
    assert lines[0].split(": error: ")[0] in (prog, prog.split()[0]), err
    assert "Traceback" not in err and out == "", (out, err)
    return lines[0]


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty working directory, no launcher variables, and the signal handlers and log level
    an entry point may set put back afterwards."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    for k in {*(k for k in os.environ if k.startswith("RECOVER_")), "RANK",
              "GLOO_SOCKET_IFNAME"}:
        monkeypatch.setenv(k, "")  # recorded, so what an entry point sets is undone too
        monkeypatch.delenv(k)
    monkeypatch.setenv("RECOVER_LOG_LEVEL", "info")  # restored: `recover` exports its level
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield work
    for s, h in handlers.items():
        signal.signal(s, h)
    assert list(work.iterdir()) == [], "an entry point created files while refusing its input"


# -- recover train -----------------------------------------------------------------------------

@pytest.fixture
def train(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[list[str]], object]:
    from recover.app.train import launch

    def started(*_: object, **__: object) -> None:
        raise Started("recover train launched a run")

    monkeypatch.setattr(launch, "launch", started)
    out = isolated.parent / "run"

    def call(extra: list[str]) -> object:
        result = cli.main(["train", "--out", str(out), *extra])
        assert not out.exists()
        return result
    return call


def test_train_starts_with_valid_flags(train: Callable[[list[str]], object]) -> None:
    """The baseline the fuzzing varies: a valid command line reaches the launcher."""
    with pytest.raises(Started):
        train(["--replicas", "2", "--port", "0"])


@pytest.mark.parametrize("action", _flags(_train_parser()), ids=_name)
@FUZZ
@given(data=st.data())
def test_train_flag(train: Callable[[list[str]], object], capsys: pytest.CaptureFixture[str],
                    action: argparse.Action, data: st.DataObject) -> None:
    argv = _argv(action, _wrong(data, action))
    _one_error_line(capsys, lambda: train(argv), "recover train")


# -- recover coordinator -----------------------------------------------------------------------

@pytest.fixture
def coord(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[list[str]], object]:
    class NoCoordinator:
        def __init__(self, *_: object) -> None:
            raise Started("recover coordinator started")

    monkeypatch.setattr(coordinator, "Coordinator", NoCoordinator)
    return lambda extra: coordinator.main(["--replicas", "2", "--port", "0",
                                           "--host", "127.0.0.1", *extra])


def test_coordinator_starts_with_valid_flags(coord: Callable[[list[str]], object]) -> None:
    with pytest.raises(Started):
        coord(["--stale-s", "1.5"])


@pytest.mark.parametrize("action", _flags(_coordinator_parser()), ids=_name)
@FUZZ
@given(data=st.data())
def test_coordinator_flag(coord: Callable[[list[str]], object],
                          capsys: pytest.CaptureFixture[str], action: argparse.Action,
                          data: st.DataObject) -> None:
    argv = _argv(action, _wrong(data, action))
    _one_error_line(capsys, lambda: coord(argv), "recover coordinator")


# -- the worker (python -m recover.app.train.worker, under torchrun on a cluster) --------------

@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory as `recover train --external-workers` leaves it for its workers (R=4)."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.json").write_text(preset("debug").replace(run={"out": str(d)}).to_json())
    (d / rundir.RUN_TOKEN).write_text("0123abcd\n")
    return d


@pytest.fixture
def work(isolated: Path, run_dir: Path,
         monkeypatch: pytest.MonkeyPatch) -> Callable[[list[str]], object]:
    from recover.app.train import loop

    def started(*_: object) -> int:
        raise Started("the worker started training")

    monkeypatch.setattr(loop, "run", started)
    # Reached only by a valid command line: a SIGUSR1 handler of this pytest process otherwise.
    monkeypatch.setattr(worker.faulthandler, "register", lambda *_, **__: None)
    before = sorted(run_dir.iterdir())

    def call(extra: list[str]) -> object:
        result = worker.main(["--run-dir", str(run_dir), "--replica", "3", "--rank", "0",
                              "--coordinator", "127.0.0.1:29500", *extra])
        assert sorted(run_dir.iterdir()) == before
        return result
    return call


def test_worker_starts_with_valid_flags(work: Callable[[list[str]], object]) -> None:
    with pytest.raises(Started):
        work(["--gloo-ifname", "lo"])


@pytest.mark.parametrize("action", _flags(worker.parser()), ids=_name)
@FUZZ
@given(data=st.data())
def test_worker_flag(work: Callable[[list[str]], object], capsys: pytest.CaptureFixture[str],
                     action: argparse.Action, data: st.DataObject) -> None:
    argv = _argv(action, _wrong(data, action))
    _one_error_line(capsys, lambda: work(argv), worker.PROG)


@pytest.mark.parametrize("var, flag", [("RECOVER_REPLICA", "--replica"), ("RANK", "--rank"),
                                       ("RECOVER_COORDINATOR", "--coordinator"),
                                       ("RECOVER_JOIN_AT", None), ("RECOVER_LOG_LEVEL", None)])
@FUZZ
@given(wrong=ALWAYS_WRONG.filter(lambda v: v.strip() != ""))
def test_worker_launch_variable(work: Callable[[list[str]], object], run_dir: Path,
                                capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch, var: str, flag: str | None,
                                wrong: str) -> None:
    """torchrun's and the launcher's variables, read where the flag is not given: a malformed one
    is named in one line (RECOVER_REPLICA=abc used to read as "not set")."""
    assume(not (var in ("RECOVER_REPLICA", "RANK", "RECOVER_JOIN_AT") and wrong.isdigit()))
    monkeypatch.setenv(var, wrong)
    argv = ["--run-dir", str(run_dir), "--replica", "3", "--rank", "0",
            "--coordinator", "127.0.0.1:29500"]
    if flag is not None:  # the variable stands in for its flag
        i = argv.index(flag)
        del argv[i:i + 2]
    line = _one_error_line(capsys, lambda: worker.main(argv), worker.PROG)
    assert var in line or flag in line, line
