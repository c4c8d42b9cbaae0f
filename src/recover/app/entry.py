"""The `recover` command's entry point: torch's C++ warnings stay off this process's terminal.

Invariant: `main` imports torch (through `recover.app.cli`) with `TORCH_CPP_LOG_LEVEL` at ERROR
unless the user set it, then puts the environment back as it was before anything else runs, so
the processes this one starts (the coordinator, the replicas, through a fork server started
later) log torch's C++ warnings into their own logs as before.

Why: torch reads `TORCH_CPP_LOG_LEVEL` once, when it is imported, and a store client whose
server died logs a warning with the whole C++ stack of the failed read (20 frames) before it
raises. The launcher reads the coordinator's store every 20 ms, so every coordinator death (81 of
82 in a 30-minute soak) put that stack on the user's terminal, above recover's own line saying
the coordinator died and is being restarted. The error itself still reaches recover, which says
what happened in one line.
"""

from __future__ import annotations

import os

_LEVEL = "TORCH_CPP_LOG_LEVEL"


def main(argv: list[str] | None = None) -> int:
    """Run the `recover` command (`recover.app.cli.main`)."""
    mine = _LEVEL not in os.environ
    if mine:
        os.environ[_LEVEL] = "ERROR"
    try:
        from recover.app import cli  # imports torch, which reads the level now
    finally:
        if mine:
            del os.environ[_LEVEL]
    return cli.main(argv)
