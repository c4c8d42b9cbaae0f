"""A run's newest checkpoint that verifies, as one plain model: what `recover sample` and
`recover export` read.

Invariant: nothing of a checkpoint is read before its manifest is authenticated with the run's
token and every file's sha256 is checked (`ckpt_files.find_latest`, as `--resume` does); the model
is rebuilt from the run's own config.json (an `hf:` model from the config it froze at launch), and
its parameters are the checkpoint's, bitwise, whatever layout wrote it: DCP reassembles FSDP2's
shards, TP's fused q/k/v rows go back to the plain order, and pipeline stages' names back to the
whole model's. No process group is made (DCP's no-process-group load); the optimizer state is not
read. Every problem is one line (`ConfigError`, `CheckpointError`).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recover.app import rundir
from recover.app.config import RunConfig
from recover.app.runtoken import run_token
from recover.app.train import foreign
from recover.app.train.checkpoint.files import find_latest, read_manifest
from recover.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)
_SCOPED = re.compile(r"^(?:(?P<stage>stage\d+)\.)?model\.(?P<name>.+)$")


@dataclass
class Restored:
    """A run's model at its newest verified checkpoint."""

    cfg: RunConfig
    model: nn.Module  # plain (unsharded), float32, on CPU, in eval mode
    step: int  # optimizer steps the parameters hold
    path: Path  # the checkpoint folder
    skipped: list[str] = field(default_factory=list)  # newer checkpoints that did not verify


def run_config(run_dir: str | Path, flag: str = "--run") -> RunConfig:
    """The config.json of a `recover train` run directory; ConfigError if it is none."""
    d = Path(run_dir)
    try:
        if not d.is_dir():
            raise ConfigError(f"{flag} {run_dir}: no such directory")
        if not (d / rundir.CONFIG).is_file():
            raise ConfigError(f"{flag} {run_dir}: not a recover run directory (no config.json)")
    except OSError as e:
        raise ConfigError(f"{flag} {run_dir}: {e.strerror or e}") from None
    return RunConfig.load(d / rundir.CONFIG)


def load_run(run_dir: str | Path) -> Restored:
    """The model of `run_dir` at its newest checkpoint that verifies."""
    d = Path(run_dir)
    cfg = run_config(d)
    key = run_token(d)
    ckpts = d / rundir.CKPT
    path, skipped = find_latest(ckpts, key) if ckpts.is_dir() else (None, [])
    if path is None:
        why = f" ({len(skipped)} did not verify: {skipped[0]})" if skipped else ""
        raise ConfigError(f"--run {run_dir}: no checkpoint that verifies in {ckpts}{why}")
    meta = read_manifest(path, key)  # authenticated, and its files checked by find_latest
    model = foreign.build_lm(cfg.model, cfg.run.seed)
    state = plain_state(_read_model_state(path), meta.get("layout") or {}, cfg)
    _check_complete(model, state, path)
    try:
        model.load_state_dict(state, strict=False)  # a tied weight's second name may be absent
    except RuntimeError as e:  # a shape that does not fit: another model
        raise CheckpointError(f"checkpoint {path} does not fit the run's model: "
                              f"{' '.join(str(e).split())[:300]}") from None
    model.eval()
    return Restored(cfg, model, int(meta["step"]), path, skipped)


def _read_model_state(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{scope: {parameter name: full tensor}} of a verified checkpoint (scope "" but for
    pipeline stages), read by DCP without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from recover.app.train.checkpoint import safe

    md = safe.read_metadata(path)  # a pickle: building only DCP's metadata records
    nested: dict[str, Any] = {}
    scopes: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in md.state_dict_metadata.items():
        m = _SCOPED.match(k)
        if m is None or not isinstance(v, TensorStorageMetadata):
            continue
        t = torch.empty(tuple(v.size), dtype=v.properties.dtype)
        scope = m["stage"] or ""
        scopes.setdefault(scope, {})[m["name"]] = t
        top = nested.setdefault(scope, {}) if scope else nested
        top.setdefault("model", {})[m["name"]] = t
    if not scopes:
        raise CheckpointError(f"checkpoint {path} holds no model parameters")
    try:
        with warnings.catch_warnings():  # "assumes a single process": it is one, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(nested, checkpoint_id=path, no_dist=True,
                     **safe.load_kwargs(path))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]}") from None
    return scopes


def plain_state(state: dict[str, dict[str, torch.Tensor]], layout: dict[str, Any],
                 cfg: RunConfig) -> dict[str, torch.Tensor]:
    """One state dict in the plain model's names and row order, from any layout's."""
    if layout.get("stages", 1) > 1:
        from recover.layouts.pp import stage_blocks

        out: dict[str, torch.Tensor] = {}
        stages = layout["stages"]
        for scope, sd in state.items():
            s = int(scope.removeprefix("stage"))
            own = list(stage_blocks(cfg.model.n_layer, stages, s))
            for name, t in sd.items():
                if name.startswith("blocks."):  # a stage numbers its blocks from 0
                    i, rest = name[len("blocks."):].split(".", 1)
                    name = f"blocks.{own[int(i)]}.{rest}"
                out[name] = t
    else:
        out = dict(state.get("", {}))
    if layout.get("tp", 1) > 1:
        from recover.app.train.parallelize import unpermute_state_dict

        out = unpermute_state_dict(out, cfg.model.n_embd, layout["tp"])
    return out


def _check_complete(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Every parameter and buffer of the model is in the checkpoint (a tied weight once), and
    nothing in the checkpoint is not the model's."""
    names = set(state)
    own = model.state_dict(keep_vars=True)
    loaded = {id(own[n]) for n in names if n in own}
    missing = sorted(n for n, t in own.items() if id(t) not in loaded)
    extra = sorted(names - set(own))
    if missing or extra:
        what = (f"missing {', '.join(missing[:3])}" if missing else
                f"unknown {', '.join(extra[:3])}")
        raise CheckpointError(f"checkpoint {path} is for a different model than the run's "
                              f"config.json ({what})")
