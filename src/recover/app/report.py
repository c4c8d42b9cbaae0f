"""`recover report DIR`: a run's Markdown report (DIR/report/report.md) and its plots (PNGs beside
it): loss and val loss against step with the faults and joins marked, live replicas over time,
recovery time per fault, the step time distribution. `recover train` writes it at the end of
every run (`--no-report`: not).

Invariant: the report is drawn from the status model (`recover.app.status`) and `metrics.jsonl`
only, so it says what `recover status` says; it is written into a private sibling folder and
renamed into place, so DIR/report is a whole report or the previous one, never half of each.
matplotlib (Agg, no display) is imported only here, when a report is drawn.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from recover.app import rundir
from recover.app.rundir import read_jsonl
from recover.app.status import read_status
from recover.errors import ExitCode, RecoverError, UsageParser, usage_line

log = logging.getLogger(__name__)

DPI = 80  # small files, quick to draw: a report is read on a screen
SIZE = (6.4, 3.2)


def write_report(run_dir: Path | str) -> Path:
    """Write DIR/report/report.md and its PNGs; the path of report.md. ConfigError if DIR is not
    a run."""
    out = Path(run_dir)
    model = read_status(out)
    recs = read_jsonl(out / rundir.METRICS)
    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the report from whoever else reads the run
    try:
        plots = _plots(model, recs, tmp)
        (tmp / rundir.REPORT_MD).write_text(markdown(model, plots))
        final = out / rundir.REPORT
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final / rundir.REPORT_MD


def _plots(model: dict[str, Any], recs: list[dict], folder: Path) -> dict[str, str]:
    """Draw each plot the run has data for; {title: file name}."""
    if not recs:
        return {}
    import matplotlib

    matplotlib.use("Agg")  # no display: a launcher on a server
    from matplotlib.figure import Figure  # no pyplot: no global figure state to leak or close

    steps = [r["step"] for r in recs]
    drawn: dict[str, str] = {}

    def save(fig: Figure, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=DPI)
        drawn[title] = name

    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    ax.plot(steps, [r["loss"] for r in recs], label="loss")
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val loss")
    for i, f in enumerate(f for f in model["faults"] if f["step"] is not None):
        ax.axvline(f["step"], color="red", ls="--", lw=1, label="fault" if i == 0 else None)
    for i, j in enumerate(model["joins"]):
        ax.axvline(j["step"], color="green", ls=":", lw=1, label="join" if i == 0 else None)
    ax.set(xlabel="step", ylabel="loss")
    ax.legend()
    save(fig, "loss.png", "Loss")

    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    ax.step([r.get("time_s", 0.0) for r in recs], [r["live_replicas"] for r in recs],
            where="post")
    ax.set(xlabel="seconds since the start", ylabel="live replicas",
           ylim=(0, model["replicas"] + 0.5))
    save(fig, "replicas.png", "Live replicas")

    if model["recoveries"]:
        fig = Figure(figsize=SIZE)
        ax = fig.add_subplot()
        # One bar per fault, labelled by its step: positions with tick labels, not the steps
        # as strings (matplotlib's category units log a line about them on the terminal).
        ax.bar(range(len(model["recoveries"])), [r["recovery_s"] for r in model["recoveries"]],
               tick_label=[str(r["step"]) for r in model["recoveries"]])
        ax.set(xlabel="step", ylabel="recovery seconds")
        save(fig, "recovery.png", "Recovery time per fault")

    fig = Figure(figsize=SIZE)
    ax = fig.add_subplot()
    ax.hist([r["step_time_s"] for r in recs if "step_time_s" in r], bins=30)
    ax.set(xlabel="step time (s)", ylabel="steps")
    save(fig, "step_time.png", "Step time distribution")
    return drawn


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(m: dict[str, Any], plots: dict[str, str]) -> str:
    """The report's text: summary, replicas, faults, recoveries, joins, then the plots."""
    lines = [f"# Run report: {m['dir']}", "",
             "| | |", "|---|---|",
             f"| state | {m['state']} |",
             f"| steps committed | {m['committed']} of {m['steps']} |",
             f"| final loss | {_f(m['loss'], '.4f')} |",
             f"| val loss | {_f(m['val_loss'], '.4f')} |",
             f"| tokens/s (last steps) | {_f(m['tokens_per_s'], ',.0f')} |",
             f"| median step time | {_f(m['step_time_s'], '.3f')} s |",
             f"| elapsed | {_f(m['elapsed_s'], '.1f')} s |",
             f"| generations | {_f(m['generation'], 'd')} |",
             f"| faults | {len(m['faults'])} |",
             f"| coordinator restarts | {m['coordinator_restarts']} |", "",
             "## Replicas", "", "| replica | state | quota | s/microbatch | how it ended |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['replica']} | {r['state']} | {_f(r['quota'], 'd')} | "
              f"{_f(r['mb_time_s'], '.4f')} | {r['exit'] or '-'} |" for r in m["replica_states"]]
    lines += ["", "## Faults", ""]
    lines += (["| at (s) | step | replica | what | reason |", "|---|---|---|---|---|"]
              + [f"| {_f(f['time_s'], '.2f')} | {_f(f['step'], 'd')} | {_f(f['replica'], 'd')} "
                 f"| {f['kind']} | {f['reason']} |" for f in m["faults"]]
              if m["faults"] else ["None."])
    lines += ["", "## Recoveries", ""]
    lines += (["| step | microbatches recomputed | seconds | attempts |", "|---|---|---|---|"]
              + [f"| {r['step']} | {r['microbatches']} | {r['recovery_s']:.3f} | "
                 f"{r['attempts']} |" for r in m["recoveries"]]
              if m["recoveries"] else ["None."])
    if m["joins"]:
        lines += ["", "## Joins", ""] + [
            f"- step {j['step']}: replica(s) {j['replicas']}, state transfer "
            f"{_f(j['transfer_s'], '.3f')} s" for j in m["joins"]]
    for title, name in plots.items():
        lines += ["", f"## {title}", "", f"![{title}]({name})"]
    return "\n".join(lines) + "\n"


def run_cli(argv: list[str]) -> int:
    """`recover report DIR`: one line naming the report, or one error line and exit 2."""
    p = UsageParser(prog="recover report", description="write a run's Markdown report and plots "
                    "(DIR/report/report.md)")
    p.add_argument("dir", metavar="DIR", help="the run directory (recover train --out)")
    args = p.parse_args(argv)
    try:
        path = write_report(args.dir)
    except RecoverError as e:
        return usage_line("recover report", e)
    except OSError as e:  # DIR not writable
        return usage_line("recover report", f"{e.filename or args.dir}: {e.strerror or e}")
    print(f"recover report: {path}", flush=True)
    return ExitCode.OK
