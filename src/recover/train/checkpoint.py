"""Atomic DCP checkpoints written and read by a single process, with no process group.

Invariant: `root/step_XXXXXXXX` either does not exist or is a complete checkpoint of the state after
exactly XXXXXXXX committed steps (model, AdamW state, RNG states, and the caller's `extra`); it is
built in a hidden temp folder and renamed into place, `root/latest` names a complete one, and
loading it into a fresh model and optimiser continues training bitwise as if never stopped. Any
problem reading one is a `CheckpointError` with one line naming the path.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from recover.errors import CheckpointError

KEEP = 3
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_FORMAT = 1


@contextmanager
def _single_process() -> Iterator[None]:
    # no_dist=True (passed by callers) keeps DCP off any process group even when one exists: only
    # this process writes, so collectives on a default group would wait for peers that never come.
    # DCP still warns on every call that it "assumes a single process"; that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "numpy": [np_name, np.asarray(np_keys).tolist(), int(np_pos), int(np_has_gauss),
                  float(np_gauss)],
        "python": [py_version, list(py_state), py_gauss],
    }


def _set_rng_state(rng: dict[str, Any]) -> None:
    raw = base64.b64decode(rng["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    name, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, state, py_gauss = rng["python"]
    random.setstate((version, tuple(state), py_gauss))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    # fsync before the rename: after a power loss the new name must not point at empty contents.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any]) -> Path:
    """Write the state after `step` committed steps to `root/step_{step:08d}`; return that path.

    Single writer per `root`: leftovers of interrupted saves and all but the newest `KEEP`
    checkpoints are deleted.
    """
    root = Path(root)
    final = root / f"step_{step:08d}"
    meta = {"format": _FORMAT, "step": step, "extra": extra, "rng": _rng_state(),
            "torch": torch.__version__}
    json.dumps(meta)  # fail on a non-JSON `extra` before anything is written
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # get_state_dict keys the optimizer state by parameter name (not by position) and, for an
    # optimizer that never stepped, "initialises" it with a zero-lr step that sets AdamW's step
    # count to 1, which would change the bias correction of every later step. So a never-stepped
    # optimizer is saved as "no state" and restored as such, never passed to get_state_dict.
    state = _state_for(model, optimizer, with_optimizer=bool(optimizer.state))
    meta["optimizer_state"] = "optim" in state
    with _single_process():
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
    # DCP has no checksums: a flipped byte would load silently. Record every file's digest.
    meta["files"] = {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    _write_atomic(tmp / "meta.json", json.dumps(meta))
    if final.exists():
        # Re-saving a step (e.g. after a resume). Directories cannot be replaced atomically; a crash
        # between these renames leaves `latest` stale, and latest_checkpoint() then falls back to
        # the newest complete step directory.
        old = root / f".old_{final.name}_{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _write_atomic(root / "latest", final.name + "\n")
    _prune(root, keep=final)
    return final


def _state_for(model: nn.Module, optimizer: torch.optim.Optimizer,
               with_optimizer: bool) -> dict[str, Any]:
    """The DCP state dict: parameters (and AdamW state) keyed by parameter name."""
    if not with_optimizer:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _prune(root: Path, keep: Path) -> None:
    # The checkpoint just written is kept even if older ones carry higher step numbers (a run
    # resumed from an earlier checkpoint): `latest` names it.
    others = [p for _, p in _step_dirs(root) if p != keep]
    for p in others[:max(0, len(others) - (KEEP - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if p.name.startswith((".tmp_step_", ".old_step_", ".latest.")):
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, else the newest complete `step_*` folder, else None."""
    root = Path(root)
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        name = ""
    if _STEP_DIR.match(name) and (root / name / "meta.json").is_file():
        return root / name
    # `latest` is missing or stale (a crash between renames): fall back to a directory scan.
    complete = [p for _, p in _step_dirs(root) if (p / "meta.json").is_file()]
    return complete[-1] if complete else None


def _cause(e: BaseException) -> str:
    """One line for an exception from deep inside DCP (which wraps the real one per rank)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: meta.json is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: {_cause(e)}"
                              ) from None
    ok = (isinstance(meta, dict) and meta.get("format") == _FORMAT
          and isinstance(meta.get("step"), int) and isinstance(meta.get("files"), dict)
          and isinstance(meta.get("rng"), dict) and isinstance(meta.get("optimizer_state"), bool))
    if not ok:
        raise CheckpointError(f"checkpoint {path}: meta.json is not a recover checkpoint's")
    return meta


def _verify_files(path: Path, meta: dict[str, Any]) -> None:
    for name, digest in meta["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match its sha256")


def _check_shapes(path: Path, md: Metadata, model: nn.Module) -> None:
    # DCP loads only the keys asked for and ignores the rest, so a checkpoint of a bigger model
    # would load "successfully" into a smaller one. Compare both key sets and every shape first.
    saved = {k[len("model."):]: v for k, v in md.state_dict_metadata.items()
             if k.startswith("model.")}
    current = get_model_state_dict(model)
    if set(saved) != set(current):
        diff = sorted(set(saved) ^ set(current))
        raise CheckpointError(f"checkpoint {path} is for a different model: parameters differ "
                              f"({', '.join(diff[:3])}{', ...' if len(diff) > 3 else ''})")
    for k, t in current.items():
        m = saved[k]
        if not isinstance(m, TensorStorageMetadata) or tuple(m.size) != tuple(t.shape):
            got = tuple(m.size) if isinstance(m, TensorStorageMetadata) else "non-tensor"
            raise CheckpointError(f"checkpoint {path} does not fit the model: {k} has shape "
                                  f"{got} in the checkpoint, {tuple(t.shape)} in the model")


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check a checkpoint's meta and every file's sha256 without loading it; return its meta."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    meta = _read_meta(path)
    _verify_files(path, meta)
    return meta


def load_checkpoint(path: Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from `path`; return its meta (`step`, `extra`, ...).

    Gradients are cleared. On a `CheckpointError` raised before the DCP read (missing, corrupt or
    mismatched files) nothing was changed.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    meta = _read_meta(path)
    _verify_files(path, meta)
    try:
        md = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} has unreadable DCP metadata: {_cause(e)}"
                              ) from None
    _check_shapes(path, md, model)
    # Without state, get_state_dict creates it by a zero step, but only when no gradient is set.
    optimizer.zero_grad(set_to_none=True)
    state = _state_for(model, optimizer, with_optimizer=meta["optimizer_state"])
    try:
        with _single_process():
            dcp.load(state, checkpoint_id=path, no_dist=True)
    except (Exception, CheckpointException) as e:
        # CheckpointException derives from BaseException, so `except Exception` alone misses it.
        raise CheckpointError(f"cannot load checkpoint {path}: {_cause(e)}") from None
    if meta["optimizer_state"]:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
        optimizer.state.clear()  # back to "never stepped", exactly as it was saved
    try:
        _set_rng_state(meta["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path} has an invalid RNG state: {_cause(e)}") from None
    return meta
