"""Reading the simulator's input files (calibrations, failure traces).

Invariant: a file that cannot be read or parsed ends in one `ConfigError` line naming the file
and what it was meant to be, never a traceback.
"""

from __future__ import annotations

import json
from typing import Any

from recover.errors import ConfigError


def read_text(path: str, what: str) -> str:
    """The file's text; `what` names it in the error ("calibration file", "failure trace")."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None


def parse_json(text: str, path: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid JSON: {e.msg} (line {e.lineno})") from None

