"""The run directory's owner: the names of the files `recover train` writes in DIR, and the one
reader of its JSON-lines files.

Invariant: every reader of DIR's JSON lines (`metrics.jsonl`, `coordinator.jsonl`) goes through
`read_jsonl`, so each sees the same records: every complete line that holds a JSON object; a line
still being written, or torn by a crash, is skipped, never an error (the run may be writing the
file at that moment). A reader that must tell a gap from the end checks the steps it got.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"  # one line per committed step (the launcher's sink writes it)
COORDINATOR_LOG = "coordinator.jsonl"  # the coordinator's events
CONFIG = "config.json"  # the run's RunConfig
EXIT_CODES = "exit_codes.json"  # each rank's exit code
REPLICA_EXITS = "replica_exits.json"  # how each replica ended, in words


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON object line of `path` ([] if absent); see the module's invariant."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
