"""User-facing errors.

Invariant: every exception recover raises derives from `RecoverError` (a fault's class keeps the
builtin base it always had, RuntimeError or OSError, as its second). Every error a user can cause
(bad config, missing file, impossible world size, corrupt checkpoint) is a `RecoverError` whose
message is one readable line; the CLI prints it without a traceback and exits non-zero. Internal
bugs are left as ordinary exceptions. Every
entry point (`recover`, `recover coordinator`, the worker) reports such an error, and a bad
command line, the one way: `usage_line`, one line on stderr, `ExitCode.USAGE`.
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
import textwrap
from typing import Any, NoReturn


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
    PREEMPTED = 8  # `recover train` was preempted (SIGTERM): checkpointed, `--resume` goes on

    @property
    def meaning(self) -> str:
        return _MEANING[self]


_MEANING = {ExitCode.OK: "finished", ExitCode.ERROR: "error",
            ExitCode.USAGE: "configuration error", ExitCode.FENCED: "fenced",
            ExitCode.BELOW_MIN: "below --min-replicas",
            ExitCode.COORDINATOR_LOST: "coordinator lost",
            ExitCode.PARTITIONED: "partitioned (heard nothing from the coordinator)",
            ExitCode.STUCK: "stuck (no progress inside a step)",
            ExitCode.PREEMPTED: "preempted (checkpointed; --resume continues)"}


class RecoverError(Exception):
    """The root of every exception recover raises: `except RecoverError` catches them all. Raised
    as itself, a `ConfigError`, a `DataError` or a `CheckpointError`, it is the user's input or
    environment at fault, reported as one line."""


class ConfigError(RecoverError):
    """The run's configuration is invalid."""


class DataError(RecoverError):
    """The training data could not be found or read."""


class CheckpointError(RecoverError):
    """A checkpoint is missing, incompatible, or corrupt."""


def usage_line(prog: str, error: object) -> int:
    """Report a user's mistake: `<prog>: error: <message>` as one line on stderr (a message's own
    line breaks are joined, so it stays one line); the exit code to end with, `ExitCode.USAGE`."""
    message = " ".join(str(error).splitlines()).strip() or type(error).__name__
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return ExitCode.USAGE


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, plus each option's default where its help does not state one (a switch,
    an unset or empty default shows none); a description's or epilog's lines that start with a
    space keep their line (wrapped under themselves), so a grammar or a table stays readable."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "(default" in text or action.nargs == 0
                or default in (None, "", [], argparse.SUPPRESS) or isinstance(default, bool)):
            return action.help
        return f"{text} (default: %(default)s)".lstrip()

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for line in text.splitlines():
            if not line.startswith(" "):  # prose: wrapped as argparse does
                out.append(textwrap.fill(" ".join(line.split()), width, initial_indent=indent,
                                         subsequent_indent=indent) if line.strip() else "")
                continue
            # An indented line, a table's row: its columns kept, wrapped under its last column.
            column = re.match(r"\s*\S.*?\s{2,}(?=\S)", line)
            hang = " " * (len(column.group()) if column else len(line) - len(line.lstrip()))
            out.append(textwrap.fill(line.rstrip(), width, initial_indent=indent,
                                     subsequent_indent=indent + hang, drop_whitespace=True))
        return "\n".join(out)


class UsageParser(argparse.ArgumentParser):
    """argparse's parser whose command-line errors (unknown flag, missing or malformed value)
    end like every other user error, in `usage_line` and exit 2; argparse's own also prints the
    usage block. `--help` shows defaults (`HelpFormatter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.exit(usage_line(self.prog, message))


def first_line(e: BaseException, limit: int = 160) -> str:
    """An exception as one line of at most `limit` characters (its first line, else its
    class's name): what a log line or a one-line error quotes of it."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__
