"""The fault matrix's shared machinery: one faulty `recover train` per test, the invariants every
scenario must keep, and the recorder that turns the runs into docs/faults.md.

Invariant: every scenario is checked by the same `check_run` (committed steps 0..S-1 exactly once,
`microbatches` = N on every line, losses within 1e-5 relative of the one failure-free reference
(`ref4`, shared with the rest of the suite), survivors bitwise equal, the last checkpoint loads
and, when the run finished, holds the survivors' final parameters). With `RECOVER_FAULTS_DOC=1`
the session writes docs/faults.md from what the runs measured and how the tests ended.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness.runs import BASE, Run, bitwise_equal, max_rel, recover_train
from recover.app import rundir
from recover.app.config import RunConfig
from recover.app.runtoken import run_token
from recover.app.train.checkpoint.dcp import latest_checkpoint, load_checkpoint
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer

N = 8
DOC = Path(__file__).resolve().parents[2] / "docs" / "faults.md"
# Checkpoints every 5 steps so that a run that stops early still leaves one to load.
CKPT = ["--ckpt-every", "5"]


def fault_args(*faults: str, replicas: int = 4, static: bool = True) -> list[str]:
    # Static (equal) quotas make "which replica computes which ids" predictable for the
    # scenarios that aim a fault at a replica's k-th microbatch.
    args = [*BASE, *CKPT, "--replicas", str(replicas), "--dump-final-params"]
    args += [] if static else ["--speed-aware"]
    for f in faults:
        args += ["--fault", f]
    return args


def faulty(tmp_path: Path, corpus: Path, *faults: str, static: bool = True,
           extra: tuple[str, ...] = (), expect_rc: int | None = 0,
           env: dict[str, str] | None = None) -> Run:
    """One faulty run; `expect_rc=None`: any non-zero exit; `env`: the launcher's environment."""
    run = recover_train(tmp_path / "run", *fault_args(*faults, static=static), *extra,
                        data=corpus, timeout=150, env=env)
    ok = run.returncode != 0 if expect_rc is None else run.returncode == expect_rc
    assert ok, (run.returncode, run.stderr[-3000:])
    return run


def load_last_checkpoint(out: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, parameters) of the run's newest verified checkpoint, loaded by the public API into
    a model initialised from another seed (so everything must come from disk)."""
    cfg = RunConfig.load(out / rundir.CONFIG)
    model = build_model(cfg.model, cfg.run.seed + 1)
    opt = build_optimizer(model, cfg)
    key = run_token(out)
    path = latest_checkpoint(out / rundir.CKPT, key)
    assert path is not None, f"no verified checkpoint under {out / 'ckpt'}"
    meta = load_checkpoint(path, model, opt, key=key)
    return int(meta["step"]), {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_run(run: Run, ref: Run, survivors: list[int], steps: int | None = None) -> list[dict]:
    """The invariants of every scenario; `steps`: how many steps committed (default: all)."""
    recs = run.metrics()
    want = len(ref.metrics()) if steps is None else steps
    assert [r["step"] for r in recs] == list(range(want)), "steps not contiguous"
    assert all(r["microbatches"] == N for r in recs), [r["microbatches"] for r in recs]
    assert max_rel(run.losses(), ref.losses()[:want]) < 1e-5
    ck_step, ck = load_last_checkpoint(run.out)
    # A run that stopped early keeps its last periodic checkpoint; a finished one, its final.
    assert (ck_step == want) if steps is None else (0 < ck_step <= want), (ck_step, want)
    if steps is None:
        finals = run.finals()
        assert sorted(finals) == survivors, (sorted(finals), survivors)
        first = finals[survivors[0]]
        assert all(bitwise_equal(first, finals[s]) for s in survivors), "survivors diverged"
        assert bitwise_equal(first, ck), "the last checkpoint is not the final state"
    return recs


def gaps(recs: list[dict]) -> list[float]:
    """Wall time between consecutive commits (the first step's includes no startup)."""
    return [b["time_s"] - a["time_s"] for a, b in zip(recs, recs[1:], strict=False)]


@dataclass
class Row:
    scenario: str
    expected: str
    measured: str = ""
    result: str = "not run"


def measure(run: Run) -> str:
    """Recovery time as the runs report it: the largest `recovery_s` of a step, and the longest
    wall gap between two commits (what a fault cost, including detection)."""
    recs = run.metrics()
    rec = max((r["recovery_s"] for r in recs), default=0.0)
    gap = max(gaps(recs), default=0.0)
    return f"recovery_s {rec:.2f}, worst commit gap {gap:.2f} s"


# The session's rows of docs/faults.md, by test id (filled through the `record` fixture).
_ROWS: dict[str, Row] = {}


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Iterator[Row]:
    """This test's row of docs/faults.md: the test fills `scenario`, `expected`, `measured`;
    the result comes from how the test ended."""
    row = Row(scenario=request.node.name, expected="")
    _ROWS[request.node.nodeid] = row
    yield row


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    report = yield
    row = _ROWS.get(item.nodeid)
    if row is not None and (report.when == "call" or report.failed):
        row.result = "pass" if report.passed else ("FAIL" if report.failed else "skipped")
    return report


NOT_COVERED: list[tuple[str, str]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    if os.environ.get("RECOVER_FAULTS_DOC") != "1" or not _ROWS:
        return
    lines = [
        "# Fault matrix",
        "",
        "Generated by `RECOVER_FAULTS_DOC=1 pytest tests/faults` (tests/faults/conftest.py); do "
        "not edit by hand.",
        "Every scenario is one real `recover train` (debug preset, R=4, N=8, 14 steps, "
        "checkpoints every 5), checked for: committed steps 0..13 exactly once, "
        "`microbatches` = 8 on every line, losses within 1e-5 relative of the failure-free "
        "reference, surviving replicas' final parameters bitwise equal, and the last checkpoint "
        "loads (and equals the final state). Times are wall seconds on the machine that ran "
        "the matrix (2 shared cores): `recovery_s` is the in-step recovery a step reported, "
        "the commit gap includes detection.",
        "",
        "| scenario | expected | measured | result |",
        "|---|---|---|---|",
    ]
    for row in _ROWS.values():
        lines.append(f"| {row.scenario} | {row.expected} | {row.measured} | {row.result} |")
    if NOT_COVERED:
        lines += ["", "## Not covered", ""]
        lines += [f"- **{name}**: {why}." for name, why in NOT_COVERED]
    DOC.write_text("\n".join(lines) + "\n")
