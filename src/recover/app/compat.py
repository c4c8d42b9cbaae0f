"""What keeps runs made by earlier recover versions working: every compatibility shim, in one place.

Invariant: each function here is the whole of one shim, called from the one place that reads the
older input, and its docstring says what it keeps working and the version that may drop it;
nothing elsewhere in recover special-cases an earlier version's output. Dropping a shim is
deleting its function and its call. The library (`recover` outside `recover.app`) has none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["flat_config_problem", "saved_sampling"]

# Top-level names of a config.json from before sub-configs that are also sub-config names now.
_FLAT_ONLY = frozenset({"data", "layout"})


def saved_sampling(d: dict[str, Any]) -> None:
    """Fill in `data.sampling` for a saved config.json that has none: a run saved before 0.5
    drew random windows (overlapping, with replacement), so its `--resume` keeps drawing them
    instead of switching to the epoch order. May be dropped in 1.0 (such a config then reads
    with the default sampling)."""
    if isinstance(d.get("data"), dict):
        d["data"].setdefault("sampling", "random")


def flat_config_problem(flat: Iterable[str], sections: dict[str, Callable[[], Any]]) -> str | None:
    """The one line for a config.json from before sub-configs (before 0.5: every field at the top
    level), or None when the top-level names `flat` are not that; `sections` maps each section
    name to its dataclass. May be dropped in 1.0 (such a config then reads as unknown fields)."""
    names = sorted(flat)
    known = {g.name for make in sections.values() for g in dataclasses.fields(make())}
    if not set(names) & (known | _FLAT_ONLY):
        return None
    return (f"a flat (pre-sub-config) config with top-level {', '.join(names)}: config.json is "
            f"now nested by sub-config ({', '.join(sections)}); start a new run, or move each "
            "field into its section")
