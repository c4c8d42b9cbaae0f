"""User-facing errors.

Invariant: every error a user can cause (bad config, missing file, impossible world size, corrupt
checkpoint) is raised as a `RecoverError` whose message is one readable line; the CLI prints it
without a traceback and exits non-zero. Internal bugs are left as ordinary exceptions.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """How a recover process ends (the one definition; the launcher and README name them)."""

    OK = 0  # trained to the last step and left cleanly
    ERROR = 1  # an unexpected error (a bug, or an intra-replica failure reported as one)
    USAGE = 2  # a configuration error, reported as one line
    FENCED = 3  # dropped from the membership (hung, or cut off and back)
    BELOW_MIN = 4  # fewer live replicas than min_replicas
    COORDINATOR_LOST = 5  # the coordinator went away and did not come back in time
    PARTITIONED = 6  # heard nothing from the coordinator for its bound
    STUCK = 7  # the main thread made no progress inside a step for the watchdog's bound

    @property
    def meaning(self) -> str:
        return _MEANING[self]


_MEANING = {ExitCode.OK: "finished", ExitCode.ERROR: "error",
            ExitCode.USAGE: "configuration error", ExitCode.FENCED: "fenced",
            ExitCode.BELOW_MIN: "below --min-replicas",
            ExitCode.COORDINATOR_LOST: "coordinator lost",
            ExitCode.PARTITIONED: "partitioned (heard nothing from the coordinator)",
            ExitCode.STUCK: "stuck (no progress inside a step)"}


class RecoverError(Exception):
    """An error caused by the user's input or environment, reported as one line."""


class ConfigError(RecoverError):
    """The run's configuration is invalid."""


class DataError(RecoverError):
    """The training data could not be found or read."""


class CheckpointError(RecoverError):
    """A checkpoint is missing, incompatible, or corrupt."""
