"""The coordinator's settings, declared once: `CoordinatorConfig`.

Invariant: each field that has a flag is `recover coordinator`'s flag of that name, default and
help, generated from the field (`add_arguments`, `from_args`), and `to_argv` writes the argv that
parses back to the same config; so a launcher, a test and the command line never spell the
coordinator's options twice. The run's secret (`token`) has no flag: a secret does not belong on a
command line (`--token-file` names a file that holds it). A `CoordinatorConfig` that exists holds
values a coordinator can serve with: each is checked at construction (`validate`), against the
bounds declared beside its field, and a bad one is a `ConfigError` of one line naming its flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.errors import ConfigError
from recover.settings import (
    MAX_PORT,
    MAX_REPLICAS,
    PORT,
    SECONDS,
    Bounds,
    FaultTolerance,
    Number,
    check_fields,
)

# Store servers beyond the main one; ~1 per 1,000 ranks (collectives/shards.py), so 256 is far
# past any run MAX_REPLICAS allows, and every shard takes a port of its own.
MAX_STORE_SHARDS = 256


def _flag(flag: str, help: str | None = None, type: Any = None,
          bounds: Bounds | None = None) -> dict[str, Any]:
    meta = {"flag": flag, "help": help, "type": type}
    if bounds is not None:  # a numeric flag: `check_fields` checks it, argparse only converts
        meta |= {"bounds": bounds, "type": Number(type, bounds)}
    return meta


@dataclass(frozen=True)
class CoordinatorConfig:
    """What a coordinator serves and how it judges its members (one field per flag)."""

    replicas: int = field(metadata=_flag("--replicas", "replicas expected to join", int,
                                         Bounds(1, MAX_REPLICAS)))
    # Loopback unless told: a store reachable from the network is a choice (docs/cli.md, "What is
    # exposed where"), and one without a token is refused unless --no-token says so (`main`).
    host: str = field(default="127.0.0.1", metadata=_flag(
        "--host", "address the store and the liveness listener bind (0.0.0.0 or :: for every "
        "interface: then a token, or --no-token)"))
    port: int = field(default=29600, metadata=_flag("--port", "store port (0 = any free port)",
                                                    int, PORT))
    # None: store port + 1 for a fixed store port (predictable for firewalls), else any.
    liveness_port: int | None = field(default=None, metadata=_flag(
        "--liveness-port", "liveness listener port (default: store port + 1; any if --port 0)",
        int, PORT))
    port_file: str | None = field(default=None, metadata=_flag(
        "--port-file", "write the chosen store port to this file"))
    stale_s: float = field(default=2.0, metadata=_flag("--stale-s", "heartbeat silence = lost",
                                                       float, SECONDS))
    join_timeout_s: float = field(default=120.0, metadata=_flag(
        "--join-timeout-s", "start without the replicas still missing after this long; give up a "
        "joiner that got no state within it", float,
        SECONDS))
    log_path: str | None = field(default=None, metadata=_flag(
        "--log", "append one JSON line per event to this file"))
    stats_path: str | None = field(default=None, metadata=_flag(
        "--stats-file", "keep the main store's request count (the coordinator's and every "
        "member's) in this JSON file, rewritten every few seconds"))
    exit_when_done: bool = field(default=False, metadata=_flag(
        "--exit-when-done", "exit once every replica has left or been lost"))
    token_file: str | None = field(default=None, metadata=_flag(
        "--token-file", "the run's secret: members must show it (default: env RECOVER_RUN_TOKEN; "
        "none: any member is accepted, on a loopback --host only unless --no-token)"))
    no_token: bool = field(default=False, metadata=_flag(
        "--no-token", "serve a --host other hosts can reach without a token: any process that "
        "reaches the ports is admitted and can forge the control plane (docs/DESIGN.md, Trust)"))
    # The run's config fingerprint (None: the first member's defines it).
    fingerprint: str | None = field(default=None, metadata=_flag(
        "--fingerprint", "the run's config fingerprint members must match (default: the first "
        "member's)"))
    # Extra store servers for the step decision's counts (collectives/shards.py); 0 or 1: the
    # main store does it all.
    store_shards: int = field(default=0, metadata=_flag(
        "--store-shards", "also host this many store servers for the step decision's counts "
        "(ports: store port + 2 on, unless --port 0 or --liveness-port: any); 0 or 1: none", int,
        Bounds(0, MAX_STORE_SHARDS)))
    # This coordinator replaces one that died: the replicas that kept running re-register with
    # the steps they applied, and its first generation resumes the run (membership.py).
    recover: bool = field(default=False, metadata=_flag(
        "--recover", "replace a coordinator of this run that died (same address): the replicas "
        "re-register and the run resumes from their last committed step"))
    token: str | None = field(default=None, repr=False)  # the run's secret itself (no flag)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ConfigError (one line, naming the flag) unless every field holds a value of its type
        in its bounds, every name a non-empty string, and a fixed store port leaves room for the
        ports derived from it."""
        check_fields(self, _label)
        for name in ("host", "port_file", "log_path", "stats_path", "token_file",
                     "fingerprint"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise ConfigError(f"{_label(name)} must not be empty")
        if self.fingerprint is not None and len(self.fingerprint.split()) != 1:
            raise ConfigError(f"{_label('fingerprint')} {self.fingerprint!r} holds whitespace: "
                              "a member's hello could never match it")
        if self.port and self.liveness_port is None:
            last = self.port + 1 + (self.store_shards if self.store_shards > 1 else 0)
            if last > MAX_PORT:
                raise ConfigError(f"--port {self.port} leaves no room for the ports derived from "
                                  f"it (liveness, shards: up to {last} > {MAX_PORT}); choose a "
                                  "lower --port or give --liveness-port")

    # -- the command line ------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, ap: argparse.ArgumentParser) -> None:
        """Add one flag per field that has one, in field order."""
        for f in _flagged():
            m = f.metadata
            kw: dict[str, Any] = {"dest": f.name}
            if m["help"] is not None:
                kw["help"] = m["help"]
            if f.default is False:
                ap.add_argument(m["flag"], action="store_true", **kw)
                continue
            if f.default is dataclasses.MISSING:
                kw["required"] = True
            else:
                kw["default"] = f.default
            if m["type"] is not None:
                kw["type"] = m["type"]
            ap.add_argument(m["flag"], metavar=m["flag"][2:].replace("-", "_").upper(), **kw)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> CoordinatorConfig:
        return cls(**{f.name: getattr(ns, f.name) for f in _flagged()})

    def to_argv(self) -> list[str]:
        """The argv of `recover coordinator` (or `python -m recover.collectives.coordinator`)
        that parses back to this config (`token` excepted: pass `token_file`)."""
        argv: list[str] = []
        for f in _flagged():
            value = getattr(self, f.name)
            if isinstance(value, bool):
                argv += [f.metadata["flag"]] if value else []
            elif value is not None:
                argv += [f.metadata["flag"], str(value)]
        return argv

    @classmethod
    def from_fault_tolerance(cls, ft: FaultTolerance, replicas: int,
                             **fields: Any) -> CoordinatorConfig:
        """A coordinator that judges silence and joins by the run's `FaultTolerance`."""
        return cls(replicas=replicas, stale_s=ft.stale_s, join_timeout_s=ft.join_timeout_s,
                   **fields)

    def file_token(self) -> str | None:
        """The secret `token_file` holds (None: no `token_file`); ConfigError (one line) when the
        file cannot be read or holds nothing: a token file that was named but is empty would
        otherwise admit any member."""
        if not self.token_file:
            return None
        try:
            token = Path(self.token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--token-file {self.token_file}: cannot read it: "
                              f"{getattr(e, 'strerror', None) or e}") from None
        if not token:
            raise ConfigError(f"--token-file {self.token_file} is empty")
        return token

    def check_outputs(self) -> None:
        """ConfigError (one line) unless each file this coordinator writes (`port_file`,
        `log_path`, `stats_path`) can be made: its folder exists and the path is no folder.
        Checked by `recover coordinator` before it starts anything."""
        for name in ("port_file", "log_path", "stats_path"):
            value = getattr(self, name)
            if value is None:
                continue
            path = Path(value)
            try:
                if path.is_dir():
                    raise ConfigError(f"{_label(name)} {value} is a directory, not a file")
                if not path.parent.is_dir():
                    raise ConfigError(f"{_label(name)} {value}: no such directory {path.parent}")
            except OSError as e:  # a name too long for the file system
                raise ConfigError(f"{_label(name)} {value}: {e.strerror or e}") from None


def _flagged() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(CoordinatorConfig) if "flag" in f.metadata]


def _label(name: str) -> str:
    """A field's flag (`--stale-s`), as errors name it; the field's name if it has none."""
    flag = CoordinatorConfig.__dataclass_fields__[name].metadata.get("flag")
    return flag or name
