"""The coordinator's settings, declared once: `CoordinatorConfig`.

Invariant: each field that has a flag is `recover coordinator`'s flag of that name, default and
help, generated from the field (`add_arguments`, `from_args`), and `to_argv` writes the argv that
parses back to the same config; so a launcher, a test and the command line never spell the
coordinator's options twice. The run's secret (`token`) has no flag: a secret does not belong on a
command line (`--token-file` names a file that holds it).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recover.settings import FaultTolerance


def _flag(flag: str, help: str | None = None, type: Any = None) -> dict[str, Any]:
    return {"flag": flag, "help": help, "type": type}


@dataclass(frozen=True)
class CoordinatorConfig:
    """What a coordinator serves and how it judges its members (one field per flag)."""

    replicas: int = field(metadata=_flag("--replicas", "replicas expected to join", int))
    host: str = field(default="0.0.0.0", metadata=_flag("--host"))
    port: int = field(default=29600, metadata=_flag("--port", "store port (0 = any free port)",
                                                    int))
    # None: store port + 1 for a fixed store port (predictable for firewalls), else any.
    liveness_port: int | None = field(default=None, metadata=_flag(
        "--liveness-port", "liveness listener port (default: store port + 1; any if --port 0)",
        int))
    port_file: str | None = field(default=None, metadata=_flag(
        "--port-file", "write the chosen store port to this file"))
    stale_s: float = field(default=2.0, metadata=_flag("--stale-s", "heartbeat silence = lost",
                                                       float))
    join_timeout_s: float = field(default=120.0, metadata=_flag("--join-timeout-s", None, float))
    log_path: str | None = field(default=None, metadata=_flag(
        "--log", "append one JSON line per event to this file"))
    exit_when_done: bool = field(default=False, metadata=_flag(
        "--exit-when-done", "exit once every replica has left or been lost"))
    token_file: str | None = field(default=None, metadata=_flag(
        "--token-file", "the run's secret: members must show it (default: env RECOVER_RUN_TOKEN; "
        "none: any member is accepted)"))
    # The run's config fingerprint (None: the first member's defines it).
    fingerprint: str | None = field(default=None, metadata=_flag(
        "--fingerprint", "the run's config fingerprint members must match (default: the first "
        "member's)"))
    # Extra store servers for the step decision's counts (collectives/shards.py); 0 or 1: the
    # main store does it all.
    store_shards: int = field(default=0, metadata=_flag(
        "--store-shards", "also host this many store servers for the step decision's counts "
        "(ports: store port + 2 on, unless --port 0 or --liveness-port: any); 0 or 1: none", int))
    # This coordinator replaces one that died: the replicas that kept running re-register with
    # the steps they applied, and its first generation resumes the run (membership.py).
    recover: bool = field(default=False, metadata=_flag(
        "--recover", "replace a coordinator of this run that died (same address): the replicas "
        "re-register and the run resumes from their last committed step"))
    token: str | None = field(default=None, repr=False)  # the run's secret itself (no flag)

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
        """The secret `token_file` holds (None: no file, or an empty one)."""
        return (Path(self.token_file).read_text().strip() or None) if self.token_file else None


def _flagged() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(CoordinatorConfig) if "flag" in f.metadata]
