"""A launch's input, checked and laid out once, before any process starts (`prepare_run`).

Invariant: user mistakes (settings a `--resume` cannot keep, a checkpoint that does not verify or
names code, a run directory that already holds a run, data that does not fit the model) are
caught here, before any process starts, as one-line RecoverErrors. The config is checked once per
launch (or comes checked, from the CLI) into an immutable `PreparedRun`, whose parsed faults the
launch reads from then on. What `--resume` chose is said on the console the caller passes in
(`say`: a line a console refuses is lost, never the run).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from recover.app import rundir
from recover.app.config import CheckedConfig, RunConfig, flatten
from recover.app.faults import Fault
from recover.app.runtoken import resume_token, run_token
from recover.app.train import foreign
from recover.app.train.data import check_token_ids, load_data, prepare_data
from recover.app.train.writers import check as check_writers
from recover.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedRun:
    """A launch's input, checked and laid out once (`prepare_run`): the config as
    DIR/config.json holds it (checked, the model resolved, the vocabulary grown to the data's; a
    copy of its own, so nothing the caller does later reaches the running launch), its fault
    specs as `RunConfig.checked` parsed them, and the step it starts from."""

    cfg: RunConfig
    faults: tuple[Fault, ...]
    start: int


def prepare_run(cfg: RunConfig | CheckedConfig, console: Console | None = None) -> PreparedRun:
    """Check the config (unless it comes checked), lay out DIR, prepare data, write
    config.json; the run as it will start. `console`: where `--resume` says what it chose
    (default: stderr)."""
    checked = cfg if isinstance(cfg, CheckedConfig) else cfg.checked()
    cfg = checked.cfg
    check_writers(cfg)  # an explicit --tensorboard/--wandb whose package is missing
    foreign.resolve(cfg.model)  # what the model is: compared on --resume, in the fingerprint
    out = Path(cfg.run.out)
    start = 0
    if cfg.run.resume:
        start = _resume_point(cfg, out, console or Console(stderr=True))
    elif (out / rundir.METRICS).exists() or _holds_files(out / rundir.CKPT):
        # An empty DIR/ckpt is not a run: it may be a volume mounted there for the checkpoints.
        raise ConfigError(f"{out} already holds a run; use --resume to continue it or choose "
                          "another --out")
    out.mkdir(parents=True, exist_ok=True)
    run_token(out, create=True)  # the key of the run's checkpoint manifests (DIR/run.token)
    (out / rundir.LOGS).mkdir(exist_ok=True)
    meta = prepare_data(cfg.data.path, out / rundir.DATA, cfg.data.val_fraction,
                        cfg.model.block_size)
    if meta["vocab_size"] > cfg.model.vocab_size:
        cfg.model.vocab_size = int(meta["vocab_size"])
    foreign.check_fits(cfg.model, int(meta["vocab_size"]))
    check_token_ids(load_data(out / rundir.DATA), cfg.model.vocab_size)
    tmp = out / f"{rundir.CONFIG}.tmp"
    tmp.write_text(cfg.to_json())
    os.replace(tmp, out / rundir.CONFIG)
    return PreparedRun(copy.deepcopy(cfg), checked.faults, start)


def _holds_files(folder: Path) -> bool:
    return folder.exists() and (not folder.is_dir() or any(folder.iterdir()))


def _resume_point(cfg: RunConfig, out: Path, console: Console) -> int:
    """The step `--resume` continues from: the newest checkpoint that verifies, if the settings
    and the layout match the saved run. Says which checkpoint and why newer ones were skipped."""
    from recover.app.train.checkpoint.dcp import check_layout
    from recover.app.train.checkpoint.files import find_latest, read_manifest
    from recover.app.train.checkpoint.ranks import layout_of

    if not (out / rundir.CKPT).is_dir():
        raise CheckpointError(f"--resume: no checkpoint found in {out / 'ckpt'}")
    key = resume_token(out)  # never a new one: it would authenticate none of the run's files
    ckpt, skipped = find_latest(out / rundir.CKPT, key)
    for line in skipped:
        say(console, f"recover: --resume {line}")
    if ckpt is None:
        raise CheckpointError(f"--resume: no checkpoint found in {out / 'ckpt'}"
                              + (" that verifies" if skipped else ""))
    _refuse_code_in(ckpt)
    saved = RunConfig.load(out / rundir.CONFIG)
    old, new = flatten(saved.trajectory_key()), flatten(cfg.trajectory_key())
    # The vocabulary grows to fit the data when it is prepared (below), after this check.
    new["model.vocab_size"] = old.get("model.vocab_size", new["model.vocab_size"])
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if diff:
        raise ConfigError(f"--resume: settings differ from the saved run in {out}: "
                          f"{', '.join(diff)} (a resumed run must keep its trajectory; "
                          "--steps is the LR schedule's horizon)")
    meta = read_manifest(ckpt, key)  # authenticated; its files were verified by find_latest
    check_layout(ckpt, meta, layout_of(cfg))
    start = int(meta["step"])
    if start >= cfg.run.steps:
        raise ConfigError(f"--resume: the run in {out} already completed all {start} steps")
    if 0 < cfg.run.stop_at <= start:
        raise ConfigError(f"--resume: --stop-at {cfg.run.stop_at} is not after step {start}, "
                          f"where the run would continue ({ckpt.name}): nothing would be "
                          "trained (give a later --stop-at, or none)")
    say(console, f"recover: --resume from {ckpt.name} (step {start})"
        + (f", skipping {len(skipped)} newer that did not verify" if skipped else ""))
    return start


def _refuse_code_in(ckpt: Path) -> None:
    """--resume reads the checkpoint's DCP metadata (a pickle) here, by the unpickler that builds
    nothing but DCP's records (`checkpoint_safe`), so one naming anything else is refused in one
    line before any process starts: its HMAC, keyed by the directory's own token, proves nothing
    about a directory someone else wrote."""
    from recover.app.train.checkpoint.safe import read_metadata

    read_metadata(ckpt)


def say(console: Console, line: str) -> None:
    """One line of `recover train`'s own output, as written (no markup, no wrapping). A console
    whose file refuses it (a full disk under a scheduler's output file, a closed pipe) loses the
    line, never the run."""
    try:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    except OSError as e:
        log.debug("console line lost (%s): %s", e.strerror or e, line)
