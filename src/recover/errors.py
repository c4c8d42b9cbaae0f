"""User-facing errors.

Invariant: every error a user can cause (bad config, missing file, impossible world size, corrupt
checkpoint) is raised as a `RecoverError` whose message is one readable line; the CLI prints it
without a traceback and exits non-zero. Internal bugs are left as ordinary exceptions.
"""

from __future__ import annotations


class RecoverError(Exception):
    """An error caused by the user's input or environment, reported as one line."""


class ConfigError(RecoverError):
    """The run's configuration is invalid."""


class DataError(RecoverError):
    """The training data could not be found or read."""


class CheckpointError(RecoverError):
    """A checkpoint is missing, incompatible, or corrupt."""
