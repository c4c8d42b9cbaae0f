"""`recover verify RUN REF`: a run checked against a failure-free run from their directories.

(a) two bitwise-equal runs pass; (b) a run that silently lost one microbatch of one step (the
test-only `drop` fault: the step still counts N) fails, naming that step, in both modes; (c) a
default-mode run with faults passes against its `--reference`, whose band `recover train`
measured and printed; what is not a pair of comparable runs is one line and exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXACT_PAIR_ARGS, shared_run
from harness.runs import Run, recover_train
from recover.app import rundir
from recover.app.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BASE = ["--preset", "debug", "--eval-every", "0", "--replicas", "3", "--microbatches", "7",
        "--steps", "10", "--no-report"]
DROP_STEP = 6


def _shared(factory: pytest.TempPathFactory, name: str, corpus: Path, *args: str) -> Run:
    """One run for every xdist worker (`conftest.shared_run`): the module's tests split across
    workers, a module fixture would train them once per worker."""
    run = shared_run(factory, f"verify-{name}", lambda out: recover_train(
        out, *args, data=corpus, timeout=200))
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory,
         exact_pair: tuple[Run, Run]) -> dict[str, Run]:
    drop = f"drop:replica=1,step={DROP_STEP}"
    f = tmp_path_factory
    return {
        "exact": exact_pair[0],  # the session's exact pair (R=5, N=7, 12 steps)
        "exact-again": exact_pair[1],
        "exact-drop": _shared(f, "exact-drop", corpus, *EXACT_PAIR_ARGS, "--fault", drop),
        "faulty": _shared(f, "faulty", corpus, *BASE, "--reference",
                          "--fault", "kill:replica=2,step=2,phase=backward"),
        "drop": _shared(f, "drop", corpus, *BASE, "--fault", drop),
    }


def _verify(capsys: pytest.CaptureFixture, *args: Path) -> tuple[int, str, str]:
    rc = main(["verify", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bitwise_equal_runs_pass(runs: dict[str, Run], capsys: pytest.CaptureFixture) -> None:
    rc, out, err = _verify(capsys, runs["exact-again"].out, runs["exact"].out)
    assert rc == 0, err
    assert "bitwise: equal at every compared step" in out and "verdict: pass" in out
    assert "microbatches: N=7 on every step" in out and "steps: 12 compared" in out


@pytest.mark.parametrize("mode", ["exact", "default"])
def test_a_dropped_microbatch_fails_naming_its_step(runs: dict[str, Run], mode: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    run, ref = ((runs["exact-drop"].out, runs["exact"].out) if mode == "exact" else
                (runs["drop"].out, runs["faulty"].out / rundir.REFERENCE))
    recs = [json.loads(x) for x in (run / rundir.METRICS).read_text().splitlines()]
    assert all(r["microbatches"] == 7 for r in recs)  # the count cannot see it
    rc, out, err = _verify(capsys, run, ref)
    assert rc == 1, out
    assert err.count("\n") == 1 and err.startswith(f"recover verify: step {DROP_STEP}:"), err
    assert "verdict: fail" in out


def test_faulty_default_run_is_judged_by_its_band(runs: dict[str, Run],
                                                  capsys: pytest.CaptureFixture) -> None:
    faulty = runs["faulty"]
    # `recover train --reference` measured the band, printed it and its verdict.
    assert "band: loss" in faulty.stdout and "verdict: pass" in faulty.stdout, faulty.stdout
    assert (faulty.out / rundir.REFERENCE / rundir.BAND).exists()
    assert (faulty.out / rundir.REFERENCE / rundir.BAND_RUN / rundir.METRICS).exists()
    rc, out, err = _verify(capsys, faulty.out, faulty.out / rundir.REFERENCE)
    assert rc == 0, err
    assert "deviation: loss" in out and "band: loss" in out and "verdict: pass" in out
    # The same band given as a run directory (--band) gives the same verdict.
    band = faulty.out / rundir.REFERENCE / rundir.BAND_RUN
    rc, out, _ = _verify(capsys, faulty.out, faulty.out / rundir.REFERENCE, Path("--band"), band)
    assert rc == 0 and "verdict: pass" in out


def test_the_command_line_end_to_end(runs: dict[str, Run]) -> None:
    p = subprocess.run([sys.executable, "-m", "recover", "verify", str(runs["exact-drop"].out),
                        str(runs["exact"].out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().startswith(f"recover verify: step {DROP_STEP}")
    assert "Traceback" not in p.stderr


def test_what_cannot_be_compared_is_one_line(runs: dict[str, Run], tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    rc, _, err = _verify(capsys, tmp_path, runs["exact"].out)  # not a run
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    # Different configurations (exact and default numerics): nothing to compare.
    rc, _, err = _verify(capsys, runs["drop"].out, runs["exact"].out)
    assert rc == 2 and "different configurations" in err
    # A default-mode pair that differs, with no band to judge it by.
    rc, _, err = _verify(capsys, runs["drop"].out, runs["faulty"].out)
    assert rc == 2 and "band" in err


def test_a_torn_last_line_is_not_a_step(runs: dict[str, Run], tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    import shutil

    copy = tmp_path / "torn"
    shutil.copytree(runs["exact-again"].out, copy, ignore=shutil.ignore_patterns("final", "ckpt"))
    text = (copy / rundir.METRICS).read_text()
    (copy / rundir.METRICS).write_text(text + text.splitlines()[-1][:40])  # a crash mid-write
    rc, out, err = _verify(capsys, copy, runs["exact"].out)
    assert rc == 0 and "verdict: pass" in out, err


def test_a_missing_line_fails_naming_its_step(runs: dict[str, Run], tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    import shutil

    copy = tmp_path / "gap"
    shutil.copytree(runs["exact-again"].out, copy, ignore=shutil.ignore_patterns("final", "ckpt"))
    lines = (copy / rundir.METRICS).read_text().splitlines(keepends=True)
    (copy / rundir.METRICS).write_text("".join(lines[:4] + lines[5:]))  # step 4's line lost
    rc, _, err = _verify(capsys, copy, runs["exact"].out)
    assert rc == 1 and err.startswith("recover verify: step 4: RUN has no line"), err


def test_the_data_is_compared_by_content_not_path(runs: dict[str, Run], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """A rerun elsewhere reads the same tokens from another path: the same data (its hash)."""
    import shutil

    copy = tmp_path / "elsewhere"
    shutil.copytree(runs["exact-again"].out, copy, ignore=shutil.ignore_patterns("final", "ckpt"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg["data"]["path"] = "/somewhere/else/text.txt"
    (copy / "config.json").write_text(json.dumps(cfg))
    rc, out, err = _verify(capsys, copy, runs["exact"].out)
    assert rc == 0 and "verdict: pass" in out, err
    meta = json.loads((copy / "data" / "meta.json").read_text())
    (copy / "data" / "meta.json").write_text(json.dumps({**meta, "sha256": "0" * 64}))
    rc, _, err = _verify(capsys, copy, runs["exact"].out)  # other tokens: not comparable
    assert rc == 2 and "different configurations" in err
