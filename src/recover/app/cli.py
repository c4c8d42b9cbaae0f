"""The `recover` command line: train, and status, watch, report, sample, export, prepare, etc.

The commands: train | status | watch | report | sample | export | coordinator | simulate | bench |
prepare.

Invariant: a user mistake ends in one readable line on stderr and a non-zero exit, never a
traceback (`recover.errors.usage_line`, exit 2 for a bad flag, value or path, checked before any
process, socket or file of the run is made); `recover train`'s flags are generated from
`RunConfig`'s field metadata (one flag per field, so a field is named and described once), and
presets only set defaults that flags override.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import threading
import time
import types
import typing
from pathlib import Path
from typing import Any

from recover import __version__
from recover.app import configfile, logs, rundir
from recover.app.config import PRESETS, CheckedConfig, RunConfig, flag_of, preset
from recover.app.faults import grammar
from recover.app.train.preempt import Preemption
from recover.control.coordconfig import CoordinatorConfig
from recover.errors import (
    ConfigError,
    ExitCode,
    HelpFormatter,
    RecoverError,
    UsageParser,
    usage_line,
)
from recover.settings import LOG_LEVELS, PORT, Number

LOG_HELP = "log level of this process and of every process it starts (default: info)"


def config_fields() -> list[tuple[str, dataclasses.Field, Any]]:
    """Every (section, field, type) of RunConfig that has a CLI flag, in declaration order."""
    out = []
    for sec in dataclasses.fields(RunConfig):
        cls = typing.get_type_hints(RunConfig)[sec.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if flag_of(f) is None:
                continue
            typ = hints[f.name]
            if typing.get_origin(typ) in (typing.Union, types.UnionType):  # `str | None` -> str
                typ = next(a for a in typing.get_args(typ) if a is not type(None))
            out.append((sec.name, f, typ))
    return out


def default_text(sec: str, f: dataclasses.Field, typ: Any) -> str:
    """How `--help` states a config flag's default: the presets' values where a preset sets the
    field ("default: from --preset (debug: 64, small: 128)"), else the field's own; "" for a
    switch, a repeatable flag, an unset default and a help text that states its default."""
    if typ is bool or typing.get_origin(typ) is list or "(default" in f.metadata["help"]:
        return ""
    if any(f.name in p.get(sec, {}) for p in PRESETS.values()):
        each = ", ".join(f"{name}: {p.get(sec, {}).get(f.name, f.default)}"
                         for name, p in PRESETS.items())
        return f" (default: from --preset ({each}))"
    return "" if f.default in (None, "") else f" (default: {f.default})"


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per config field, named, described and typed by the field's metadata; its help
    states the default (`default_text`) and its metavar the choices, as `{a,b}`."""
    groups: dict[str, Any] = {}
    for sec, f, typ in config_fields():
        if sec not in groups:
            cls = typing.get_type_hints(RunConfig)[sec]
            groups[sec] = p.add_argument_group(f"cfg.{sec}", cls.__doc__.splitlines()[0])
        g, flag, dest = groups[sec], flag_of(f), f"{sec}.{f.name}"
        hlp = (f.metadata["help"] + default_text(sec, f, typ)).replace("%", "%%")
        # validate() checks a choice, for flags and config files alike; "" (unset) is no choice.
        shown = [repr(c) if "," in c else c for c in f.metadata["choices"] if c]
        metavar = f.metadata["metavar"] or ("{" + ",".join(shown) + "}" if shown else
                                            flag.lstrip("-").replace("-", "_").upper())
        if typ is bool:  # a switch: stores the field's `const` (--speed-aware: True)
            g.add_argument(flag, dest=dest, action="store_const", const=f.metadata["const"],
                           default=None, help=hlp)
        elif typing.get_origin(typ) is list:  # repeatable: --fault A --fault B
            g.add_argument(flag, dest=dest, action="append", default=None,
                           metavar=metavar, help=hlp)
        else:  # None = not given: the preset's value stays; validate() checks the bounds
            bounds = f.metadata.get("bounds")
            g.add_argument(flag, dest=dest, type=typ if bounds is None else Number(typ, bounds),
                           default=None, metavar=metavar, help=hlp)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run resilient pre-training on this machine",
                       description="Start a coordinator and R replica processes and train.",
                       formatter_class=HelpFormatter, epilog=grammar())
    p.add_argument("--config", metavar="FILE",
                   help="settings from a TOML file or an earlier run's config.json (sections and "
                        "keys as in config.json); flags given here override them")
    add_config_flags(p)
    p.add_argument("--external-workers", action="store_true",
                   help="start no replicas here: serve the coordinator on --port and wait for "
                        "replicas launched elsewhere (torchrun), writing metrics")
    p.add_argument("--port", type=Number(int, PORT), default=0,
                   help="coordinator store port (0 = any)")
    p.add_argument("--host", default=None,
                   help="address the coordinator's store and liveness listener bind (default: "
                        "127.0.0.1, or every interface with --external-workers)")
    p.add_argument("--http-port", type=Number(int, PORT), default=None,
                   help="serve the run's status read-only over HTTP on this port (GET /status: "
                        "JSON, GET /metrics: Prometheus; 0 = any free port, written to "
                        "DIR/http.port; default: no endpoint)")
    p.add_argument("--http-host", default=None,
                   help="the one address the HTTP endpoint binds (default: 127.0.0.1)")
    # SUPPRESS: given here, it overrides the top-level option; absent, the top-level one stays.
    p.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help=LOG_HELP)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The preset named by --preset, then the --config file's settings, then every flag given on
    the command line; checked (`checked_from_args`)."""
    return checked_from_args(args).cfg


def checked_from_args(args: argparse.Namespace) -> CheckedConfig:
    """`config_from_args`, as the one check of the launch hands it on (`recover train`)."""
    path = getattr(args, "config", None)
    values, dropped = configfile.read(path) if path is not None else ({}, None)
    cfg = (configfile.layered(values, getattr(args, "run.preset"), path) if path is not None
           else preset(getattr(args, "run.preset") or "debug"))
    given: dict[str, dict[str, Any]] = {}
    for sec, f, _ in config_fields():
        v = getattr(args, f"{sec}.{f.name}")
        if v is not None:
            given.setdefault(sec, {})[f.name] = v
    for sec, changes in given.items():  # frozen sections (ft, compute) too: a new one each
        setattr(cfg, sec, dataclasses.replace(getattr(cfg, sec), **changes))
    if getattr(args, "run.out") is None and "out" not in values.get("run", {}):
        cfg.run.out = f"runs/{cfg.run.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.run.reference:
        cfg.run.dump_final = True  # the final parameters are compared with the reference's too
    checked = cfg.checked()
    try:
        if cfg.data.path is not None and not Path(cfg.data.path).exists():
            raise ConfigError(f"--data {cfg.data.path}: no such file or directory")
        check_out(cfg.run.out)
    except OSError as e:  # a name too long for the file system, a path through a locked folder
        raise ConfigError(f"{e.filename or cfg.run.out}: {e.strerror or e}") from None
    configfile.announce(path, dropped)
    return checked


def check_out(out: str) -> None:
    """ConfigError unless the run directory `out` is a directory or can be made one: no file in
    its place or on its path, and a directory can be created where it goes (tried, and removed:
    nothing of the run is made here). OSError where the path itself cannot be looked at."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, not a directory")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".recover-probe-").cleanup()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create a directory in {existing}: "
                          f"{e.strerror or e}") from None


def check_coordinator(cfg: RunConfig, args: argparse.Namespace) -> str:
    """The address the coordinator will bind, checked with the coordinator's own validation
    (`CoordinatorConfig`), as the launcher will build it; ConfigError on a bad --port/--host."""
    if args.external_workers and not args.port:
        raise ConfigError("--external-workers needs a fixed --port for the replicas to reach")
    host = args.host if args.host is not None else (
        "0.0.0.0" if args.external_workers else "127.0.0.1")
    CoordinatorConfig.from_fault_tolerance(cfg.ft.to_library(), cfg.layout.replicas, host=host,
                                           port=args.port, store_shards=cfg.ft.store_shards)
    return host


def http_config(args: argparse.Namespace) -> Any:
    """The endpoint's `HttpConfig` (None: no --http-port), checked before anything starts: the
    port's bounds, prometheus_client installed, the address bindable here."""
    if args.http_port is None:
        if args.http_host is not None:
            raise ConfigError("--http-host needs --http-port (the endpoint is off without it)")
        return None
    from recover.app.endpoint import HttpConfig, check_address, need_prometheus

    PORT.check("--http-port", args.http_port, integer=True)
    need_prometheus()
    http = HttpConfig(args.http_port, args.http_host or "127.0.0.1")
    check_address(http)
    return http


def cmd_train(args: argparse.Namespace, preempt: threading.Event | None = None) -> int:
    from rich.console import Console

    from recover.app.train.launch import launch
    from recover.app.train.reference import compare_final_params, max_rel_loss_diff, plot_trajectory
    from recover.app.train.writers import check as check_writers
    from recover.app.train.writers import tensorboard_dir

    console = Console(stderr=True)
    checked = checked_from_args(args)
    cfg = checked.cfg
    host = check_coordinator(cfg, args)
    check_writers(cfg)  # before any process: an explicit --tensorboard/--wandb not installed
    http = http_config(args)
    res = launch(checked, console, external_workers=args.external_workers, port=args.port,
                 host=host, http=http, preempt=preempt)
    if cfg.run.report:
        _write_report(console, res.out)
    if not res.ok:
        print(f"recover train: {res.message}", file=sys.stderr)
        return ExitCode.PREEMPTED if res.preempted else 1
    _summary(console, res)
    if cfg.run.reference:
        # Its own TensorBoard folder (DIR/reference/tensorboard) when TensorBoard is on, and no
        # second W&B run.
        tb = "none" if tensorboard_dir(cfg) is None else "auto"
        ref_out = Path(cfg.run.out) / rundir.REFERENCE
        ref_cfg = cfg.replace(ft={"faults": []}, run={"reference": False, "resume": False,
                                                      "out": str(ref_out),
                                                      "tensorboard": tb, "wandb": None})
        console.print("recover: running the failure-free reference ...", highlight=False,
                      soft_wrap=True)
        ref = launch(ref_cfg, console, quiet=True)
        if not ref.ok:
            print(f"recover train: reference run failed: {ref.message}", file=sys.stderr)
            return 1
        png = Path(cfg.run.out) / rundir.TRAJECTORY_PNG
        plot_trajectory(res.records, ref.records, png)
        diff = max_rel_loss_diff(res.records, ref.records)
        equal, rel_l2 = compare_final_params(Path(cfg.run.out), Path(ref_cfg.run.out))
        console.print(f"trajectory plot: {png}", highlight=False, soft_wrap=True)
        print(f"final_params_bitwise_equal={str(equal).lower()} final_params_rel_l2={rel_l2:.3e}")
        # Exactly zero is printed as 0: exact mode's promise is that, not a small number.
        print(f"max_rel_loss_diff={diff:.3e}" if diff else "max_rel_loss_diff=0", flush=True)
        if not cfg.compute.exact and not _measure_band(console, ref_cfg):
            return 1
        return _verdict(Path(cfg.run.out), Path(ref_cfg.run.out))
    return 0


def _measure_band(console: Any, ref_cfg: Any) -> bool:
    """The default mode's band: the reference against a failure-free run that groups the same
    N microbatches over one replica fewer (one more for a single replica), kept as
    REF/band.json (`recover.app.verify`). False (said) if that run failed."""
    from recover.app.train.launch import launch
    from recover.app.verify import write_band

    replicas = ref_cfg.layout.replicas
    other = replicas - 1 if replicas > 1 else 2
    band_cfg = ref_cfg.replace(layout={"replicas": other},
                               run={"out": str(Path(ref_cfg.run.out) / rundir.BAND_RUN),
                                    "tensorboard": "none"})
    console.print(f"recover: measuring the band: the reference regrouped over {other} "
                  "replica(s) ...", highlight=False, soft_wrap=True)
    band = launch(band_cfg, console, quiet=True)
    if not band.ok:
        print(f"recover train: the band's run failed: {band.message}", file=sys.stderr)
        return False
    write_band(Path(ref_cfg.run.out), Path(band_cfg.run.out))
    return True


def _verdict(run: Path, ref: Path) -> int:
    """`recover verify RUN REF`'s lines and verdict, under the comparison above."""
    from recover.app.verify import verify

    v = verify(run, ref)
    for line in v.lines:
        print(line)
    print("verdict: pass" if v.ok else f"verdict: fail ({v.failure})", flush=True)
    return 0 if v.ok else 1


def _write_report(console: Any, out: Path) -> None:
    """The end-of-run report (recover.app.report); a failure to draw it is said, and changes
    nothing about how the run ended."""
    from recover.app.report import write_report

    try:
        path = write_report(out)
    except Exception as e:  # a report is never worth failing a trained run for
        logging.getLogger(__name__).warning("no report written: %s", e)
        return
    console.print(f"report: {path}", highlight=False, markup=False, soft_wrap=True)


def _summary(console, res) -> None:  # type: ignore[no-untyped-def]
    recs = res.records
    if not recs:
        return
    last = recs[-1]
    gens = last["generation"]
    recovered = sum(len(r["recovered"]) for r in recs)
    tokens = recs[-1]["tokens"] - (recs[0]["tokens"] - recs[0]["tokens"] // (recs[0]["step"] + 1))
    train_s = sum(r["step_time_s"] for r in recs)
    val = next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), float("nan"))
    console.print(
        f"[bold]done[/]: {len(recs)} steps, final loss {last['loss']:.4f}, val loss {val:.4f}, "
        f"{tokens / max(train_s, 1e-9):,.0f} tok/s while training ({res.wall_s:.1f}s wall incl. "
        f"startup), live replicas {last['live_replicas']}, membership changes {gens}, "
        f"microbatches recovered {recovered}; outputs in {res.out}", highlight=False,
        soft_wrap=True)  # one line, never wrapped: piped output is grepped


def cmd_coordinator(argv: list[str]) -> int:
    """`recover coordinator`: the library's entry point, whose flags are `CoordinatorConfig`'s
    fields (the launcher builds the same argv with `CoordinatorConfig.to_argv`)."""
    from recover.control.coordinator import main as coordinator_main

    return coordinator_main(argv)


def _interrupt() -> None:
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (coordinator, simulate and bench parse their own arguments)."""
    ap = UsageParser(prog="recover", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"recover {__version__}")
    ap.add_argument("--log-level", choices=LOG_LEVELS, default="info", help=LOG_HELP)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _train_parser(sub)
    sub.add_parser("sample", help="print text sampled from a trained run's newest checkpoint")
    sub.add_parser("export", help="write a trained run's newest checkpoint as safetensors "
                   "(or a transformers folder)")
    sub.add_parser("coordinator", help="run the control plane for a multi-node job")
    sub.add_parser("simulate", help="cluster-scale discrete-event simulator")
    sub.add_parser("bench", help="recover vs checkpoint-restart vs shrink-batch, side by side")
    sub.add_parser("prepare", help="tokenise a corpus into token shards for train --data")
    sub.add_parser("status", help="print a run's state: step, ETA, replicas, faults")
    sub.add_parser("watch", help="show a run's state, refreshed until it ends")
    sub.add_parser("report", help="write a run's Markdown report and plots (DIR/report)")
    sub.add_parser("verify", help="check a run against a failure-free run of its config, from "
                   "their metrics lines (bitwise with --exact, else within the band)")
    return ap


def _leading_log_level(argv: list[str]) -> tuple[str | None, list[str]]:
    """`--log-level L` (or `--log-level=L`) given before the command: (L, the rest)."""
    if argv and argv[0].startswith("--log-level="):
        return argv[0].split("=", 1)[1], argv[1:]
    if len(argv) >= 2 and argv[0] == "--log-level":
        return argv[1], argv[2:]
    return None, argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    level, rest = _leading_log_level(argv)
    if level is not None and level not in LOG_LEVELS:
        return usage_line("recover", f"--log-level {level!r}: choose from {', '.join(LOG_LEVELS)}")
    logs.setup(level or "info", export=True)  # worker processes inherit the level
    if rest and rest[0] in ("coordinator", "simulate", "bench", "prepare", "sample", "export",
                            "status", "watch", "report", "verify"):
        return _run_tool(rest[0], rest[1:])
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level, export=True)  # `recover train --log-level L` may override
    # SIGTERM (a scheduler preempting the job) asks `recover train` to checkpoint and stop
    # within --preempt-grace-s; a second one ends it like Ctrl-C (the launcher's cleanup ends
    # its children by PID).
    preempt = Preemption(_interrupt).install()
    try:
        if args.cmd == "train":
            return cmd_train(args, preempt.requested)
    except RecoverError as e:
        return usage_line(f"recover {args.cmd}", e)
    except KeyboardInterrupt:
        print("recover: interrupted", file=sys.stderr)
        return 130
    return ExitCode.OK


def _run_tool(cmd: str, argv: list[str]) -> int:
    """The commands that parse their own arguments: coordinator, simulate, bench, prepare,
    sample, export, status, watch, report, verify."""
    if cmd == "coordinator":
        return cmd_coordinator(argv)
    if cmd == "sample":
        from recover.app.sample import run_cli as sample_cli

        return sample_cli(argv)
    if cmd == "export":
        from recover.app.export import run_cli as export_cli

        return export_cli(argv)
    if cmd in ("status", "watch"):
        from recover.app.statusview import run_cli as status_cli

        return status_cli(cmd, argv)
    if cmd == "verify":
        from recover.app.verify import run_cli as verify_cli

        return verify_cli(argv)
    if cmd == "report":
        from recover.app.report import run_cli as report_cli

        return report_cli(argv)
    if cmd == "prepare":
        from recover.app.prepare import run_cli as prepare_cli

        return prepare_cli(argv)
    if cmd == "simulate":
        from recover.app.sim.cli import run_cli

        return run_cli(argv)
    from recover.app.baselines.bench import run_cli as bench_cli

    return bench_cli(argv)


if __name__ == "__main__":
    sys.exit(main())
