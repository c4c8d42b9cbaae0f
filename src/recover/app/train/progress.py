"""What `recover train` shows while it trains: a progress bar on a terminal, plain lines otherwise.

Invariant: every line this view writes is one physical line, as written (never wrapped, no markup
codes when not a terminal), so `grep` and log scrapers see whole records. Not on a terminal
(piped, redirected), each step line starts with the wall-clock time (ISO 8601, local) and carries
the elapsed time and the ETA; one line per `--log-every` steps, plus every step with an event (a
fault, a recovery, a join, a validation loss) and the last. On a terminal, a rich progress bar
(step, loss, tokens/s, elapsed, ETA) and one line per event above it. Quiet: only checkpoint
errors (a run without checkpoints must be noticed).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def clock(seconds: float) -> str:
    """Seconds as h:mm:ss (elapsed time, ETA)."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def stamp() -> str:
    """The wall-clock time, ISO 8601 to the second, with its UTC offset."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


class Eta:
    """Seconds to the last of `steps` steps at the mean rate since the first step it saw; nan
    before a second step (no rate yet)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.first: tuple[float, int] | None = None

    def __call__(self, step: int, t: float) -> float:
        """`t`: the step's commit time (any clock, the same one at every call)."""
        if self.first is None:
            self.first = (t, step)
        t0, s0 = self.first
        done = step - s0
        return (t - t0) / done * (self.steps - 1 - step) if done > 0 else float("nan")


def step_line(rec: dict[str, Any], steps: int, eta: float) -> str:
    """A step's plain line: step/total, loss, val, lr, tok/s, live, gen, recovered, elapsed,
    ETA; the launcher's (piped) and every replica's log say a step the same way."""
    val = f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
    rcv = (f"  recovered {len(rec['recovered'])} microbatch(es) in {rec['recovery_s']:.2f}s"
           if rec["recovered"] or rec["attempts"] > 1 else "")
    left = "?" if eta != eta else clock(eta)  # nan: no rate yet
    return (f"step {rec['step']:>5}/{steps}  loss {rec['loss']:.4f}{val}  "
            f"lr {rec['lr']:.2e}  {rec['tokens_per_s']:>9,.0f} tok/s  "
            f"live {rec['live_replicas']}  gen {rec['generation']}{rcv}  "
            f"elapsed {clock(rec['time_s'])}  eta {left}")


class ProgressView:
    """The console side of the metrics sink: `step(rec, events)` per committed step, `close()`."""

    def __init__(self, console: Console, start: int, steps: int, quiet: bool = False,
                 log_every: int = 1) -> None:
        self.console, self.quiet = console, quiet
        self.start, self.steps, self.every = start, steps, max(1, log_every)
        self.eta = Eta(steps)
        self.bar: Progress | None = None
        self.task: Any = None
        if not quiet and console.is_terminal:
            self.bar = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                console=console, transient=False)
            self.task = self.bar.add_task("train", total=steps, completed=start, loss="-",
                                          tps="-")
            self.bar.start()

    def say(self, line: str) -> None:
        """One line, as written; timestamped when not on a terminal."""
        if not self.console.is_terminal:
            line = f"{stamp()} {line}"
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def eta_s(self, rec: dict[str, Any]) -> float:
        """Seconds to the last step (`Eta`), from the step's commit time since the run's start."""
        return self.eta(rec["step"], rec["time_s"])

    def step(self, rec: dict[str, Any], events: list[str]) -> None:
        """Show a committed step's line (see the invariant) and its events."""
        if "ckpt_error" in rec:  # even when quiet: a run without checkpoints must be noticed
            then = ("training goes on; the next save point tries again"
                    if rec["step"] < self.steps - 1 else "the run's last checkpoint is missing")
            self.say(f"recover: step {rec['step']}: {rec['ckpt_error']} ({then})")
        if self.quiet:
            return
        eta = self.eta_s(rec)
        for e in events:
            self.say(f"recover: step {rec['step']}: {e}")
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"] + 1, loss=f"{rec['loss']:.4f}",
                            tps=f"{rec['tokens_per_s']:,.0f}")
            if "val_loss" in rec:
                self.say(f"step {rec['step']}: val loss {rec['val_loss']:.4f}")
            return
        if events or "val_loss" in rec or rec["step"] % self.every == 0 \
                or rec["step"] == self.steps - 1:
            self.say(step_line(rec, self.steps, eta))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
