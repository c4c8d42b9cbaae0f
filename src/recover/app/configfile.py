"""Settings files for `recover train --config FILE`: a TOML file, or an earlier run's config.json.

Invariant: a file holds what config.json holds (sections model, optim, data, ft, layout, compute,
run; keys the fields' names), layered preset < file < command-line flags; every section and key
is a known one and every value is checked (type, bounds, choices) and named `section.key` in a
one-line ConfigError before anything of the run starts. From an earlier run's config.json (a
`.json` file) the fields that were that run's own and not its settings (`RUN_OWN`: its directory,
its resume, its pause point, the faults injected into it) are not carried over; a TOML file is
the user's own and every key in it counts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from recover.app.config import PRESETS, RunConfig, check_values, preset
from recover.errors import ConfigError

log = logging.getLogger(__name__)

# An earlier run's fields that describe that run, not how to train: carried over, they would
# write into its directory (out), expect its checkpoint there (resume), stop where it was told to
# pause (stop_at, possibly past a shorter --steps), and inject its faults, which no flag removes.
RUN_OWN = {"run": ("out", "resume", "stop_at"), "ft": ("faults",)}
SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


def read(path: str) -> tuple[dict[str, dict[str, Any]], list[str] | None]:
    """The settings in `path`, by section, and for a .json file the RUN_OWN fields dropped from
    it whose value differed from a fresh run's (`announce` them once the run is checked; None:
    a TOML file); ConfigError (one line) on anything else."""
    p = Path(path).expanduser()
    kind = p.suffix.lower()
    if kind not in (".toml", ".json"):
        raise ConfigError(f"--config {path}: expected a .toml file or a run's config.json")
    try:
        raw = p.read_bytes()
        d = _toml().loads(raw.decode()) if kind == ".toml" else json.loads(raw)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # TOML, JSON, UTF-8 (all ValueError subclasses)
        raise ConfigError(f"--config {path} is not valid {kind[1:].upper()}: "
                          f"{' '.join(str(e).split())}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--config {path}: expected sections {', '.join(SECTIONS)}")
    for sec, values in d.items():
        if sec not in SECTIONS:
            raise ConfigError(f"--config {path}: unknown section {sec!r} (sections: "
                              f"{', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"--config {path}: {sec} must be a table of settings")
    return d, _drop_run_own(d) if kind == ".json" else None


def announce(path: str, dropped: list[str] | None) -> None:
    """Say what of an earlier run's config.json was not carried over (nothing for TOML)."""
    if dropped is not None:
        log.info("--config %s: a new run with that run's settings (not carried over: its "
                 "directory%s)", path, "".join(f", {k}" for k in dropped))


def _drop_run_own(d: dict[str, dict[str, Any]]) -> list[str]:
    """Remove RUN_OWN's fields from an earlier run's settings `d`; those (other than out) whose
    value differed from a fresh run's, as `section.key`."""
    fresh, dropped = RunConfig(), []
    for sec, keys in RUN_OWN.items():
        for key in keys:
            if key in d.get(sec, {}):
                value = d[sec].pop(key)
                if key != "out" and value != getattr(getattr(fresh, sec), key):
                    dropped.append(f"{sec}.{key}")
    return dropped


def layered(values: dict[str, dict[str, Any]], name: str | None, path: str) -> RunConfig:
    """The preset (`name`, else the file's run.preset, else debug) with the file's `values` on
    top, every field checked and named `section.key` on error."""
    name = name or values.get("run", {}).get("preset") or "debug"
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"--config {path}: unknown run.preset {name!r}; choose from "
                          f"{', '.join(PRESETS)}")
    d = dataclasses.asdict(preset(name))
    for sec, changes in values.items():
        d[sec].update(changes)
    try:
        cfg = RunConfig.from_dict(d)
        for sec in SECTIONS:
            check_values(getattr(cfg, sec), sec)
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}") from None
    return cfg


def _toml() -> Any:
    """The TOML reader: tomllib (Python 3.11+), else tomli where it is installed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError("--config FILE.toml needs Python 3.11+ or the tomli package "
                              "(pip install tomli); a run's config.json needs neither") from None
    return tomllib
