"""The run directory's owner: the name of every file `recover train` (and `recover bench`) writes
in DIR, and the one reader of its JSON files.

Invariant: a file of DIR is named here and nowhere else in src/ (a writer or reader joins DIR with
these constants), and every reader of DIR's JSON goes through this module: `read_jsonl` for the
JSON-lines files (`metrics.jsonl`, `coordinator.jsonl`), `read_json` for the one-document files.
`read_jsonl`'s rule, the same for every caller: each complete line that holds a JSON object is a
record, in file order; a line that does not parse as one is skipped, never an error. So the last
line, still being written or torn by a crash (no newline, cut mid-object), is not a record, while
a last line cut just after its closing brace (only the newline lost) is whole and counts; a
malformed line in the middle (two writers' lines run together after a crash) is skipped the same
way. A reader that must tell a gap from the end checks the steps it got (`recover verify` does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# DIR, as `recover train --out DIR` lays it out (launch.py writes each, at the moment named).
CONFIG = "config.json"  # the run's RunConfig (written before any process starts)
RUN_START = "run_start"  # time.time() of the launch, the base of every record's `time_s`
RUN_TOKEN = "run.token"  # the run's secret (`recover.app.runtoken`), mode 0600
METRICS = "metrics.jsonl"  # one line per committed step (the launcher's sink writes it)
COORDINATOR_LOG = "coordinator.jsonl"  # the coordinator's events
# The coordinator's port, written once it listens (`CoordinatorConfig.port_file`), and, if it
# could not start, the reason: what workers a scheduler started wait for (train/worker.py).
COORDINATOR_PORT = "coordinator.port"
COORDINATOR_FAILED = "coordinator.failed"
STORE_STATS = "store_stats.json"  # the coordinator's count of main-store requests
EXIT_CODES = "exit_codes.json"  # each rank's exit code (the launcher's last act but one)
REPLICA_EXITS = "replica_exits.json"  # how each replica ended, in words (its last act)
HTTP_PORT = "http.port"  # the endpoint's port (`--http-port 0`: the one it got)
LOGS = "logs"  # every process's own output
COORDINATOR_OUT = "coordinator.log"  # the coordinator's stdout and stderr, in LOGS
DATA = "data"  # the run's prepared data (`recover.app.train.data`)
DATA_META = "meta.json"  # DATA's description: its tokens' hash, or the prepared folder it names
CKPT = "ckpt"  # the checkpoints (`recover.app.train.checkpoint`)
FINAL = "final"  # each rank's final parameters, to compare runs bitwise (`final_params`)
FINAL_GLOB = "replica*.pt"  # matches every one of them
REPORT = "report"  # `recover report`'s folder: REPORT_MD and its plots
REPORT_MD = "report.md"
TENSORBOARD = "tensorboard"  # `--tensorboard auto`'s event files
# `recover train --reference`: the failure-free run in DIR/REFERENCE, the band's run in
# DIR/REFERENCE/BAND_RUN, the band itself as DIR/REFERENCE/BAND, the two trajectories' plot.
REFERENCE = "reference"
BAND_RUN = "band"
BAND = "band.json"
TRAJECTORY_PNG = "trajectory.png"

# `recover bench --out DIR`: one run directory per system (named by the system), and these.
BENCH_CALIBRATION = "bench.json"  # the simulator's calibration (`recover.app.baselines.measure`)
BENCH_RUNS = "bench_runs.json"  # every launch's raw timings and records
BENCH_TABLE = "bench.md"
BENCH_PLOT = "bench.png"


def replica_log(replica: int, rank: int = 0) -> str:
    """The name, in LOGS, of one rank's output: `replica{r}.log` for rank 0,
    `replica{r}.rank{k}.log` for the others."""
    return f"replica{replica}.log" if rank == 0 else f"replica{replica}.rank{rank}.log"


def final_params(replica: int, rank: int = 0, nranks: int = 1) -> str:
    """The name, in FINAL, of one rank's final parameters."""
    return f"replica{replica}.pt" if nranks == 1 else f"replica{replica}.rank{rank}.pt"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of the JSON-lines file `path` ([] if absent); see the module's invariant."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # the torn last line, or a malformed one: not a record
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_json(path: Path) -> Any:
    """The JSON document in `path`, or None when it is absent or not JSON (read while its writer
    replaces it, or torn): DIR's one-document files are facts a reader can do without."""
    try:
        return json.loads(path.read_text(errors="replace"))
    except (FileNotFoundError, IsADirectoryError, ValueError):
        return None
