"""Every `bench/*.py` script the README lists, in its `--smoke` mode: it starts, measures
something real and prints its figure line, a finite number, so a bench cannot silently break.

Benchmarks are not tests: this file is not in the README's test command (pyproject's testpaths);
CI runs it as its own step, `python -m pytest bench/test_smoke.py`. The scripts run two at a time
(they are mostly process start-up, one core each; RECOVER_SMOKE_JOBS overrides), each under its
own limit; each case waits for its script and checks its exit code, its figure lines and their
numbers. Every process a script leaves when its limit passes is ended by PID (`recover.procs`).
`recover bench --smoke` is tests/test_bench.py; `recover simulate`'s fast modes are checked in
tests/test_sim_cli.py.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from recover import procs

BENCH = Path(__file__).resolve().parent
# Each script's figure lines: the last line first, then the others it prints.
FIGURES = {
    "rejoin": ("rejoin_gbps", "rejoin_protocol_s", "rejoin_vs_dcp_load", "link_vs_dcp_load",
               "rejoin_vs_link", "link_gbps"),
    "soak": ("violations",),
    "soak-exact": ("violations",),
    "exact_cost": ("exact_step_time_ratio", "exact_step_time_ratio_debug"),
    "degraded": ("degraded_efficiency",),
    "memory": ("extra_grad_buffers",),
    "overhead": ("overhead_ratio", "cpu_overhead_ratio"),
    "scale": ("main_store_requests_per_failure_per_replica", "store_ops_per_rank_step",
              "recovery_cpu_ratio", "recovery_cpu_outside_collective_ratio",
              "failure_free_reduce_cpu_ratio", "same_work_cpu_ratio"),
    "recovery": ("recovery_median_s",),
    "tree": ("tree_vs_ring_cpu", "ring_cpu_growth", "tree_cpu_growth"),
    "band": ("band_separation", "band_fault_ratio_max", "band_drop_ratio_min"),
    "noise_floor": ("noise_floor",),
}  # longest first: the pool's lanes then end about together
# A case that runs a script with flags: case -> (script, flags after --smoke).
VARIANTS = {"soak-exact": ("soak", ["--exact"])}
SCRIPT_S = 180.0  # one script's limit (5-30 s each on an idle 2-core machine)


# -- the bench/*.py scripts, on the pool ------------------------------------------------------
@dataclass
class Smoke:
    returncode: int | None  # None: ended at its limit
    stdout: str
    stderr: str
    wall_s: float


def run_script(name: str, out: Path) -> Smoke:
    """`python bench/<name>.py --smoke` (a variant's script and flags), to its end or its limit
    (then ended, with what it left)."""
    script, flags = VARIANTS.get(name, (name, []))
    cmd = [sys.executable, str(BENCH / f"{script}.py"), "--smoke", *flags, "--out",
           str(out / name)]
    stdout, stderr = out / f"{name}.out", out / f"{name}.err"
    t0 = time.monotonic()
    proc = procs.start(cmd, stdout, stderr, env=dict(os.environ, OMP_NUM_THREADS="1"))
    code = None
    try:
        code = procs.wait_exit(proc, SCRIPT_S)
    finally:
        if code is None:  # SIGINT: the script's own cleanup ends its processes by PID
            kids = procs.descendants(proc.pid)
            procs.stop(proc, grace_s=15.0, sig=signal.SIGINT)
            procs.kill_pids(kids)
    return Smoke(code, stdout.read_text(errors="replace"), stderr.read_text(errors="replace"),
                 time.monotonic() - t0)


@pytest.fixture(scope="module")
def smokes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str, Future[Smoke]]]:
    """The selected scripts' runs, started at once on a pool of RECOVER_SMOKE_JOBS lanes."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker would start every script
        pytest.fail("bench/test_smoke.py runs its scripts on its own pool: run it with -n 0",
                    pytrace=False)
    wanted = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and "name" in item.callspec.params}
    out = tmp_path_factory.mktemp("smoke")
    jobs = int(os.environ.get("RECOVER_SMOKE_JOBS", "0")) or min(2, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        yield {name: pool.submit(run_script, name, out) for name in FIGURES if name in wanted}


def figures(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line
                and line.split("=", 1)[0].isidentifier())


@pytest.mark.slow
# Its script started at the latest when the case before it ended: this bounds the wait.
@pytest.mark.timeout(SCRIPT_S + 60)
@pytest.mark.parametrize("name", list(FIGURES))
def test_bench_script_smoke(name: str, smokes: dict[str, Future[Smoke]]) -> None:
    res = smokes[name].result()
    script, flags = VARIANTS.get(name, (name, []))
    where = (f"bench/{script}.py --smoke {' '.join(flags)} ({res.wall_s:.1f}s):\n"
             f"{res.stderr[-3000:]}")
    assert res.returncode == 0, where
    last = res.stdout.strip().splitlines()[-1]
    key, _, value = last.partition("=")
    assert key == FIGURES[name][0], f"last line {last!r}; {where}"
    found = figures(res.stdout)
    for key in FIGURES[name]:
        assert key in found, f"no {key}= line; {where}"
        assert math.isfinite(float(found[key])), f"{key}={found[key]}; {where}"
