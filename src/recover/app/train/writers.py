"""Metrics writers: TensorBoard and Weights & Biases, behind one small interface the sink calls.

Invariant: a writer receives exactly what `metrics.jsonl` holds, one call per committed step in
step order (`write(step, scalars, texts)`: every numeric field of the line, and the run's events
at that step as text), and is closed exactly once, whatever happened (`Writers.close`). The
packages are imported only when a writer is opened, so a run without them pays nothing; a writer
asked for explicitly whose package is missing is a one-line `ConfigError` before the run starts
(`check`), never a traceback. A writer that fails while the run trains is logged once and dropped:
the metrics view never stops training, and `metrics.jsonl` stays the record.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from recover.app import rundir
from recover.app.config import RunConfig, flatten
from recover.errors import ConfigError

log = logging.getLogger(__name__)

OFF = ("none", "off", "no", "false", "0")  # `--tensorboard none`: no event files
AUTO = "auto"  # DIR/tensorboard when the package is installed


class MetricsWriter(Protocol):
    """One metrics backend: the scalars and event texts of each committed step, then close."""

    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None: ...

    def close(self) -> None: ...


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def tensorboard_dir(cfg: RunConfig) -> Path | None:
    """Where the TensorBoard event files go, or None (off, or `auto` without the package)."""
    want = cfg.run.tensorboard.strip()
    if want.lower() in OFF:
        return None
    if want.lower() == AUTO:
        return Path(cfg.run.out) / rundir.TENSORBOARD if _installed("tensorboard") else None
    return Path(want)


def check(cfg: RunConfig) -> None:
    """ConfigError (exit 2) when a writer asked for explicitly cannot be made: its package is
    missing. Checked before any process of the run starts."""
    tb = cfg.run.tensorboard.strip().lower()
    if tb not in OFF and tb != AUTO and not _installed("tensorboard"):
        raise ConfigError(f"--tensorboard {cfg.run.tensorboard}: the tensorboard package is not "
                          "installed (pip install 'recover[tensorboard]'), or use --tensorboard "
                          "none")
    if cfg.run.wandb:
        if not _installed("wandb"):
            raise ConfigError(f"--wandb {cfg.run.wandb}: the wandb package is not installed "
                              "(pip install 'recover[wandb]')")
        import wandb

        try:  # wandb's own rules for a project name (length, no / \\ # ? % :)
            wandb.Settings(project=cfg.run.wandb)
        except Exception as e:  # pydantic's ValidationError: take its first message
            errors = getattr(e, "errors", None)
            msg = errors()[0]["msg"] if callable(errors) else str(e)
            raise ConfigError(f"--wandb {cfg.run.wandb}: {msg.splitlines()[0]}") from None


def hparams_of(cfg: RunConfig) -> dict[str, Any]:
    """The run's config, flattened (`optim.lr`), as values TensorBoard's hparams accept."""
    out: dict[str, Any] = {}
    for k, v in flatten(json.loads(cfg.to_json())).items():
        out[k] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
    return out


class TensorBoardWriter:
    """`torch.utils.tensorboard.SummaryWriter` into one folder: a scalar per field, a text per
    event, and the config as hparams (in this run's own event file, not a sub-run)."""

    def __init__(self, folder: Path, cfg: RunConfig, start: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.folder = folder
        # A resumed run rewrites steps >= start (as metrics.jsonl): TensorBoard drops the
        # earlier run's events from there on.
        self.w = SummaryWriter(log_dir=str(folder), purge_step=start or None)
        # add_hparams would write them to a new sub-folder (a second run in TensorBoard's list);
        # its three summaries in this writer's file attach them to the run itself.
        for summary in hparams(hparams_of(cfg), {"loss": 0.0, "val_loss": 0.0}):
            self.w.file_writer.add_summary(summary)
        self.w.add_text("config", "```\n" + cfg.to_json() + "\n```", 0)

    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        for tag, v in scalars.items():
            self.w.add_scalar(tag, v, step)
        for tag, text in texts.items():
            self.w.add_text(tag, text, step)

    def close(self) -> None:
        self.w.close()  # flushes


class WandbWriter:
    """One W&B run (`wandb.init`), in the run directory; WANDB_MODE (e.g. offline) is wandb's
    own. Texts are history values at their step (a string column next to the scalars)."""

    def __init__(self, project: str, cfg: RunConfig) -> None:
        import wandb

        out = Path(cfg.run.out)
        where = Path(os.environ.get("WANDB_DIR") or out)
        where.mkdir(parents=True, exist_ok=True)  # else wandb warns it is no git root
        # console="off": wandb would otherwise wrap this process's stdout and stderr.
        self.run = wandb.init(project=project, dir=str(where),
                              name=out.name, config=json.loads(cfg.to_json()),
                              settings=wandb.Settings(console="off", silent=True))
        self.folder = Path(self.run.dir).parent  # .../wandb/<offline-run-...>/files -> the run

    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.run.log({**scalars, **texts}, step=step)

    def close(self) -> None:
        self.run.finish()


class Writers:
    """Every writer of a run; a failing one is logged and dropped, the others go on."""

    def __init__(self, writers: list[MetricsWriter] | None = None) -> None:
        self.writers = list(writers or [])

    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        for w in list(self.writers):
            try:
                w.write(step, scalars, texts)
            except Exception as e:  # a metrics view must never stop training
                log.warning("%s failed at step %d and is dropped: %s", type(w).__name__, step, e)
                self.writers.remove(w)
                self._close(w)

    def close(self) -> None:
        writers, self.writers = self.writers, []
        for w in writers:
            self._close(w)

    @staticmethod
    def _close(w: MetricsWriter) -> None:
        try:
            w.close()
        except Exception as e:
            log.warning("closing %s failed: %s", type(w).__name__, e)


def open_writers(cfg: RunConfig, start: int = 0) -> tuple[Writers, list[str]]:
    """The run's writers from step `start` on, and a line per writer saying where it writes."""
    check(cfg)
    made: list[MetricsWriter] = []
    where: list[str] = []
    tb = tensorboard_dir(cfg)
    try:
        if tb is not None:
            try:
                made.append(TensorBoardWriter(tb, cfg, start))
                where.append(f"tensorboard: {tb} (tensorboard --logdir {tb})")
            except OSError as e:  # a full disk or a read-only folder: metrics.jsonl goes on
                log.warning("no TensorBoard events for this run: %s", e)
                where.append(f"tensorboard: not written ({e.strerror or e})")
        if cfg.run.wandb:
            wb = WandbWriter(cfg.run.wandb, cfg)
            made.append(wb)
            where.append(f"wandb: project {cfg.run.wandb}, run {wb.folder}")
    except Exception:
        Writers(made).close()
        raise
    return Writers(made), where
