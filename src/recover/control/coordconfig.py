"""The coordinator's settings, declared once: `CoordinatorConfig`.

Invariant: each field that has a flag is `recover coordinator`'s flag of that name, default and
help, generated from the field (`add_arguments`, `from_args`), and `to_argv` writes the argv that
parses back to the same config; so a launcher, a test and the command line never spell the
coordinator's options twice. The bounds it judges members by (`stale_s`, `join_timeout_s`) are
not its own: it is a `recover.settings.MemberTimeouts`, whose one declaration every member's
`FaultTolerance` shares, and `from_fault_tolerance` takes them whole from a run's. Its fields are
declared with `recover.settings.setting`, as every setting is. The run's secret (`token`) has no
flag: a secret does not belong on a command line (`--token-file` names a file that holds it). A
`CoordinatorConfig` that exists holds values a coordinator can serve with: each is checked at
construction (`validate`), against the bounds declared beside its field, and a bad one is a
`ConfigError` of one line naming its flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.errors import ConfigError
from recover.settings import (
    MAX_PORT,
    MAX_REPLICAS,
    PORT,
    Bounds,
    FaultTolerance,
    MemberTimeouts,
    Number,
    check_fields,
    flag_of,
    setting,
)

# Store servers beyond the main one; ~1 per 1,000 ranks (control/shards.py), so 256 is far
# past any run MAX_REPLICAS allows, and every shard takes a port of its own.
MAX_STORE_SHARDS = 256


def store_shards_setting() -> Any:
    """The `store_shards` field, declared once for the coordinator's flag and for the run
    config that launches one (`recover train --store-shards`)."""
    return setting(0, "store servers the coordinator also hosts for the step decision's counts "
                   "(~1 per 1,000 ranks; ports: the store port + 2 on, any with --port 0 or "
                   "--liveness-port); 0 or 1: none", bounds=Bounds(0, MAX_STORE_SHARDS))


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig(MemberTimeouts):
    """What a coordinator serves and how it judges its members (one field per flag; `stale_s`
    and `join_timeout_s`, its flags --stale-s and --join-timeout-s, are `MemberTimeouts`')."""

    replicas: int = setting(help="replicas expected to join", bounds=Bounds(1, MAX_REPLICAS))
    # Loopback unless told: a store reachable from the network is a choice (docs/cli.md, "What is
    # exposed where"), and one without a token is refused unless --no-token says so (`main`).
    host: str = setting("127.0.0.1", "address the store and the liveness listener bind (0.0.0.0 "
                        "or :: for every interface: then a token, or --no-token)")
    port: int = setting(29600, "store port (0 = any free port)", bounds=PORT)
    # None: store port + 1 for a fixed store port (predictable for firewalls), else any.
    liveness_port: int | None = setting(None, "liveness listener port (default: store port + 1; "
                                        "any if --port 0)", bounds=PORT)
    port_file: str | None = setting(None, "write the chosen store port to this file")
    log_path: str | None = setting(None, "append one JSON line per event to this file",
                                   flag="--log")
    stats_path: str | None = setting(None, "keep the main store's request count (the "
                                     "coordinator's and every member's) in this JSON file, "
                                     "rewritten every few seconds", flag="--stats-file")
    exit_when_done: bool = setting(False, "exit once every replica has left or been lost")
    token_file: str | None = setting(None, "the run's secret: members must show it (default: env "
                                     "RECOVER_RUN_TOKEN; none: any member is accepted, on a "
                                     "loopback --host only unless --no-token)")
    no_token: bool = setting(False, "serve a --host other hosts can reach without a token: any "
                             "process that reaches the ports is admitted and can forge the "
                             "control plane (docs/DESIGN.md, Trust)")
    # The run's config fingerprint (None: the first member's defines it).
    fingerprint: str | None = setting(None, "the run's config fingerprint members must match "
                                      "(default: the first member's)")
    # Extra store servers for the step decision's counts (control/shards.py); 0 or 1: the
    # main store does it all.
    store_shards: int = store_shards_setting()
    # This coordinator replaces one that died: the replicas that kept running re-register with
    # the steps they applied, and its first generation resumes the run (membership.py).
    recover: bool = setting(False, "replace a coordinator of this run that died (same address): "
                            "the replicas re-register and the run resumes from their last "
                            "committed step")
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
        hints = typing.get_type_hints(cls)
        for f in _flagged():
            flag, bounds = flag_of(f), f.metadata.get("bounds")
            kw: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
            if f.default is False:
                ap.add_argument(flag, action="store_true", **kw)
                continue
            if f.default is dataclasses.MISSING:
                kw["required"] = True
            else:
                kw["default"] = f.default
            if bounds is not None:  # a number: `check_fields` checks it, argparse only converts
                kind = next(t for t in (int, float) if t in (hints[f.name],
                                                              *typing.get_args(hints[f.name])))
                kw["type"] = Number(kind, bounds)
            ap.add_argument(flag, metavar=flag[2:].replace("-", "_").upper(), **kw)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> CoordinatorConfig:
        return cls(**{f.name: getattr(ns, f.name) for f in _flagged()})

    def to_argv(self) -> list[str]:
        """The argv of `recover coordinator` (or `python -m recover.control.coordinator`)
        that parses back to this config (`token` excepted: pass `token_file`)."""
        argv: list[str] = []
        for f in _flagged():
            value = getattr(self, f.name)
            if isinstance(value, bool):
                argv += [flag_of(f)] if value else []
            elif value is not None:
                argv += [flag_of(f), str(value)]
        return argv

    @classmethod
    def from_fault_tolerance(cls, ft: FaultTolerance, replicas: int,
                             **fields: Any) -> CoordinatorConfig:
        """A coordinator that judges silence and joins by the run's `FaultTolerance` (its
        `MemberTimeouts`, taken whole)."""
        shared = {f.name: getattr(ft, f.name) for f in dataclasses.fields(MemberTimeouts)}
        return cls(replicas=replicas, **shared, **fields)

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
    """The fields that are flags: the coordinator's own first (--replicas leads its help), then
    the `MemberTimeouts` it shares with every member."""
    shared = {f.name for f in dataclasses.fields(MemberTimeouts)}
    return sorted((f for f in dataclasses.fields(CoordinatorConfig)
                   if f.metadata and flag_of(f) is not None), key=lambda f: f.name in shared)


def _label(name: str) -> str:
    """A field's flag (`--stale-s`), as errors name it; the field's name if it has none."""
    return flag_of(CoordinatorConfig.__dataclass_fields__[name]) or name
