"""Logging set-up for recover's processes: the CLI and every worker process.

Invariant: configured once per process, at its entry point (`recover` itself, the worker's
`main`); library modules only create named loggers (`logging.getLogger(__name__)`) and never
configure handlers. Every line carries a timestamp, its level and its logger's name. The level
reaches worker processes through the environment (`RECOVER_LOG_LEVEL`, read by
`recover.settings.LaunchEnv`), which every launcher passes on to its children.
"""

from __future__ import annotations

import logging
import os
import sys

from recover.settings import LOG_LEVELS

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ENV = "RECOVER_LOG_LEVEL"


def setup(level: str = "info", *, export: bool = False) -> None:
    """Log to stderr at `level` (one of LOG_LEVELS); `export`: also hand the level to the child
    processes this one starts (through their inherited environment)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=level.upper(), format=FORMAT, stream=sys.stderr, force=True)
    if export:
        os.environ[ENV] = level
