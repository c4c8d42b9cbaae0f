"""`recover status DIR` (one screen) and `recover watch DIR` (the same, refreshed until the run
ends): the status model (`recover.app.status`) drawn with rich.

Invariant: these views only read the run directory (through `read_status`); they draw nothing the
model does not hold, so they show what `/status` serves. `watch` is bounded: it returns once the
run's end is on disk (`replica_exits.json`), after `--timeout`, or at Ctrl-C (exit 0: stopping to
watch is not an error). A DIR that is not a run is one line and exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from recover.app.status import read_status
from recover.deadline import Deadline
from recover.errors import ExitCode, RecoverError, UsageParser, usage_line

WEEK_S = 7 * 24 * 3600.0
SHOWN = 5  # the last faults and recoveries a screen lists


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    return str(datetime.timedelta(seconds=round(s)))


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def headline(m: dict[str, Any]) -> str:
    step = "-" if m["step"] is None else f"{m['step'] + 1}/{m['steps']}"
    members = (f"members {m['members']}" if m["state"] != "finished" else
               f"members at the last step {m['step_members']}")
    return (f"{m['dir']}: {m['state']}, step {step}, elapsed {_dur(m['elapsed_s'])}, "
            f"ETA {_dur(m['eta_s']) if m['state'] != 'finished' else '-'}\n"
            f"loss {_num(m['loss'], '.4f')}, val loss {_num(m['val_loss'], '.4f')}, "
            f"{_num(m['tokens_per_s'], ',.0f')} tok/s, step time {_num(m['step_time_s'], '.3f')}s"
            f"\ngeneration {_num(m['generation'], 'd')}, live replicas {m['live_replicas']}/"
            f"{m['replicas']}, {members}, store requests {_num(m['store_requests'], ',d')}")


def render(m: dict[str, Any], head: bool = True) -> Group:
    """One screen: the headline (unless not `head`), each replica, the last faults and
    recoveries."""
    reps = Table(title="replicas", title_justify="left", expand=False)
    for col in ("replica", "state", "since", "quota", "s/microbatch", "ended"):
        reps.add_column(col)
    for r in m["replica_states"]:
        reps.add_row(str(r["replica"]), r["state"], _clock(r["since"]),
                     _num(r["quota"], "d"), _num(r["mb_time_s"], ".4f"), r["exit"] or "-")
    parts: list[Any] = [Text(headline(m)), reps] if head else [reps]
    if m["faults"]:
        ft = Table(title=f"last faults ({len(m['faults'])} in all)", title_justify="left")
        for col in ("time", "step", "replica", "what", "reason"):
            ft.add_column(col)
        for f in m["faults"][-SHOWN:]:
            ft.add_row(_clock(f["time"]), _num(f["step"], "d"), _num(f["replica"], "d"),
                       f["kind"], f["reason"])
        parts.append(ft)
    else:
        parts.append(Text("faults: none"))
    if m["recoveries"]:
        rt = Table(title=f"last recoveries ({len(m['recoveries'])} in all)", title_justify="left")
        for col in ("step", "at", "microbatches recomputed", "seconds", "attempts"):
            rt.add_column(col)
        for r in m["recoveries"][-SHOWN:]:
            rt.add_row(str(r["step"]), _dur(r["time_s"]), str(r["microbatches"]),
                       f"{r['recovery_s']:.3f}", str(r["attempts"]))
        parts.append(rt)
    if m["joins"]:
        parts.append(Text("joins: " + "; ".join(
            f"step {j['step']}: replica(s) {j['replicas']}" for j in m["joins"][-SHOWN:])))
    return Group(*parts)


def _seconds(lo: float) -> Any:
    """argparse type: a number of seconds in [lo, a week]."""
    def parse(text: str) -> float:
        v = float(text)
        if not lo <= v <= WEEK_S:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r}: must be in [{lo:g}, {WEEK_S:g}] seconds")
        return v
    return parse


def build_parser(cmd: str) -> argparse.ArgumentParser:
    what = ("print a run's state once" if cmd == "status" else
            "show a run's state, refreshed until the run ends (Ctrl-C stops watching)")
    p = UsageParser(prog=f"recover {cmd}", description=what)
    p.add_argument("dir", metavar="DIR", help="the run directory (recover train --out)")
    if cmd == "status":
        p.add_argument("--json", action="store_true", help="the status model as JSON")
    else:
        p.add_argument("--interval", type=_seconds(0.1), default=2.0,
                       help="seconds between refreshes (default: 2)")
        p.add_argument("--timeout", type=_seconds(0.0), default=0.0,
                       help="stop watching after this many seconds (default: 0 = when the "
                            "run ends)")
    return p


def run_cli(cmd: str, argv: list[str]) -> int:
    """`recover status` / `recover watch`."""
    args = build_parser(cmd).parse_args(argv)
    try:
        model = read_status(args.dir)
    except RecoverError as e:
        return usage_line(f"recover {cmd}", e)
    console = Console(soft_wrap=False)
    if cmd == "status":
        if args.json:
            import json

            print(json.dumps(model, indent=1))
        else:
            # The headline neither wrapped nor cropped: a piped `recover status | grep` sees each
            # fact whole on its line, whatever the width.
            console.print(headline(model), highlight=False, markup=False, soft_wrap=True)
            console.print(render(model, head=False), highlight=False)
        return ExitCode.OK
    return _watch(args, model, console)


def _watch(args: argparse.Namespace, model: dict[str, Any], console: Console) -> int:
    from rich.live import Live

    deadline = Deadline(args.timeout) if args.timeout > 0 else None
    try:
        with Live(render(model), console=console, auto_refresh=False) as live:
            while model["state"] != "finished":
                if deadline is not None and deadline.passed():
                    break
                time.sleep(args.interval)
                try:
                    model = read_status(args.dir)
                except RecoverError as e:  # the directory went away under us
                    print(f"recover watch: {e}", file=sys.stderr)
                    return ExitCode.USAGE
                live.update(render(model), refresh=True)
    except KeyboardInterrupt:
        pass  # stopping to watch is what Ctrl-C means here: not an error
    if not console.is_terminal:
        console.line()  # piped, Live leaves its last frame without the final line break
    return ExitCode.OK
