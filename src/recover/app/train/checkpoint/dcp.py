"""DCP checkpoints of the training state: one process, or all ranks of one replica together.

Invariant: `root/step_XXXXXXXX` either does not exist or is a complete checkpoint of the state after
exactly XXXXXXXX committed steps (model, AdamW state, RNG states, the caller's `extra`, and the
replica layout that wrote it), published atomically by one writer (`ckpt_files`: own temp folder,
rename, authenticated manifest, `latest` never moves back). A multi-rank replica saves with DCP's
collective save over its own process group: every rank writes its shards into the writer's temp
folder, and the replica's rank 0 publishes it once DCP's final collective says every rank finished.
A save the storage refuses (a full disk, no permission, an I/O error), on any rank, fails on every
rank of the replica alike, publishes nothing and leaves no temp folder: the caller decides what a
failed save means (the trainer logs it and goes on). Loading verifies the manifest (HMAC with the
run token) and every file's sha256 before DCP reads anything, reads DCP's pickles with an
unpickler that builds nothing but its metadata (`checkpoint_safe`: the HMAC proves nothing about
a received directory, which brings its own token), refuses another layout, and continues training
bitwise as if never stopped. Any problem is a `CheckpointError` with one line
naming the path.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
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

from recover.app.train.checkpoint import files, safe
from recover.app.train.checkpoint.files import FORMAT, find_latest
from recover.errors import CheckpointError

PLAIN = {"layout": "plain", "shards": 1, "tp": 1, "stages": 1}


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    # no_dist=True (single-process saves) keeps DCP off any process group even when one exists:
    # only this process writes, so collectives on a default group would wait for peers that never
    # come. DCP still warns on every call that it "assumes a single process"; that is the intent.
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


def _state_for(model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool,
               scope: str) -> dict[str, Any]:
    """The DCP state dict: parameters (and AdamW state) keyed by parameter name; under `scope`
    (a pipeline stage) when ranks hold different modules whose names would clash."""
    if not with_optimizer:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    return {scope: state} if scope else state


def _unscoped(state: dict[str, Any], scope: str) -> dict[str, Any]:
    return state[scope] if scope else state


def _bcast_text(text: str, group: dist.ProcessGroup) -> str:
    """Rank 0's string on every rank of `group` (tensors only: nothing is unpickled)."""
    data = text.encode()
    if len(data) > 512:
        raise ValueError(f"name too long to broadcast: {text[:40]}...")
    buf = bytearray(512)
    buf[:len(data)] = data
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    dist.broadcast(raw, group_src=0, group=group)
    return bytes(raw.tolist()).rstrip(b"\0").decode()


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any], *, key: bytes, group: dist.ProcessGroup | None = None,
                    scope: str = "", layout: dict[str, Any] | None = None) -> Path:
    """Write the state after `step` committed steps to `root/step_{step:08d}`; return that path.

    `key`: the run token (authenticates the manifest). `group`: the replica's ranks, all of which
    call this together (None: this process alone). `scope`: this rank's namespace (pipeline
    stages). `layout`: recorded (None: plain), and required to match on load. If another writer
    already published this step (and it verifies), theirs is kept and ours dropped.

    If the storage fails on any rank (a full disk or quota, no permission, an I/O error) every
    rank raises `CheckpointError` together: nothing was published, `latest` did not move and the
    temp folder is gone. Only a failure of the group itself (a rank that died) is raised as is.
    """
    root = Path(root)
    rank = dist.get_rank(group) if group is not None else 0
    final = files.step_dir(root, step)
    meta = {"format": FORMAT, "step": step, "extra": extra, "rng": _rng_state(),
            "torch": torch.__version__, "layout": layout or PLAIN, "scoped": bool(scope)}
    json.dumps(meta)  # fail on a non-JSON `extra` before anything is written
    # get_state_dict keys the optimizer state by parameter name (not by position) and, for an
    # optimizer that never stepped, "initialises" it with a zero-lr step that sets AdamW's step
    # count to 1, which would change the bias correction of every later step. So a never-stepped
    # optimizer is saved as "no state" and restored as such, never passed to get_state_dict.
    state = _state_for(model, optimizer, bool(optimizer.state), scope)
    meta["optimizer_state"] = "optim" in _unscoped(state, scope)
    tmp = _writer_folder(root, final, rank, group)
    failed: CheckpointError | None = None
    try:
        # With a group, DCP gathers every rank's outcome and raises on all of them if any
        # failed; its last collective returns only after every rank's files and .metadata exist.
        _dcp(dcp.save, state, tmp, group)
    except (CheckpointException, OSError) as e:  # a BaseException: `except Exception` misses it
        failed = CheckpointError(f"cannot save checkpoint {final}: {_cause(e)}{_space(tmp)}")
    bug: Exception | None = None  # not the storage's fault: raised as is, once agreed on
    if rank == 0 and failed is None:
        try:
            files.write_manifest(tmp, meta, key)
            files.publish(root, tmp, final, key)
        except (OSError, CheckpointError) as e:  # agreed on below: the others must not wait
            failed = CheckpointError(f"cannot save checkpoint {final}: {_cause(e)}{_space(tmp)}")
        except Exception as e:
            bug, failed = e, CheckpointError(f"cannot save checkpoint {final}: {_cause(e)}")
    # On return every rank knows the same outcome: the step published, or nothing was.
    if group is not None and not _agree(failed is None, step, group) and failed is None:
        failed = CheckpointError(f"cannot save checkpoint {final}: another rank of this replica "
                                 "failed to write its part (see its log)")
    if failed is not None:
        if rank == 0:  # the writer's own folder: nobody else may remove it while it lives
            shutil.rmtree(tmp, ignore_errors=True)
        raise bug if bug is not None else failed
    return final


def _space(folder: Path) -> str:
    """What is left on `folder`'s file system, as the failure happened: torch's writer reports a
    full disk as an "unexpected pos" RuntimeError, without the errno."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return ""
    return f" ({st.f_bavail * st.f_frsize / 2**20:.1f} MiB free on its file system)"


def _writer_folder(root: Path, final: Path, rank: int, group: dist.ProcessGroup | None) -> Path:
    """The writer's empty temp folder for `final`, made by rank 0 and named to every rank of
    `group`; a `CheckpointError` on every rank if it cannot be made."""
    name, why = "", "rank 0 of this replica could not create its folder (see its log)"
    if rank == 0:
        tmp = root / f".tmp_{final.name}_{files.writer_tag()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # our own leftover: the tag holds our PID
            tmp.mkdir()
            name = tmp.name
        except OSError as e:
            why = _cause(e) + _space(root)
    if group is not None:
        name = _bcast_text(name, group)  # "": it failed, and every rank says so
    if not name:
        raise CheckpointError(f"cannot save checkpoint {final}: {why}")
    return root / name


def latest_checkpoint(root: Path, key: bytes) -> Path | None:
    """The newest checkpoint in `root` that verifies (see `find_latest` for what was skipped)."""
    return find_latest(Path(root), key)[0]


def verify_checkpoint(path: Path, key: bytes) -> dict[str, Any]:
    """Authenticate a checkpoint's manifest and check every file without loading; return it."""
    return files.verify(Path(path), key)


def _dcp(op: Any, state: dict[str, Any], path: Path, group: Any, **how: Any) -> None:
    """DCP save or load: collective over `group`, or this process alone; `how`: a load's reader
    and planner (`safe.load_kwargs`)."""
    if group is None:
        with _quiet_no_dist():
            op(state, checkpoint_id=path, no_dist=True, **how)
    else:
        op(state, checkpoint_id=path, process_group=group, **how)


def _cause(e: BaseException) -> str:
    """One line for an exception from deep inside DCP (which wraps the real one per rank)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def describe(layout: dict[str, Any]) -> str:
    """`--layout hsdp --shards 2`, as the user typed it."""
    flags = [f"--layout {layout.get('layout')}"]
    flags += [f"--{k} {layout[k]}" for k in ("shards", "tp", "stages") if layout.get(k, 1) != 1]
    return " ".join(flags)


def check_layout(path: Path, meta: dict[str, Any], layout: dict[str, Any]) -> None:
    saved = meta.get("layout") or PLAIN
    if saved != layout:
        raise CheckpointError(f"checkpoint {path} was written by {describe(saved)}; this run is "
                              f"{describe(layout)}: resume with the same layout (resharding is "
                              "not supported)")


def _check_shapes(path: Path, md: Metadata, model: nn.Module, scope: str) -> None:
    # DCP loads only the keys asked for and ignores the rest, so a checkpoint of a bigger model
    # would load "successfully" into a smaller one. Compare both key sets and every shape first
    # (a DTensor's shape is the global one, so this holds for every rank of a sharded layout).
    prefix = f"{scope}.model." if scope else "model."
    saved = {k[len(prefix):]: v for k, v in md.state_dict_metadata.items()
             if k.startswith(prefix)}
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


def _checked(path: Path, model: nn.Module, key: bytes, scope: str,
             layout: dict[str, Any] | None) -> dict[str, Any]:
    """Everything that can refuse a checkpoint, in the order that keeps unpickling last."""
    meta = files.verify(path, key)  # HMAC first, then every file's digest
    for field, kind in (("rng", dict), ("optimizer_state", bool), ("extra", dict)):
        if not isinstance(meta.get(field), kind):
            raise CheckpointError(f"checkpoint {path}: its manifest lacks {field!r}")
    check_layout(path, meta, layout or PLAIN)
    if bool(meta.get("scoped")) != bool(scope):
        raise CheckpointError(f"checkpoint {path} was written by another layout")
    # A pickle, read last and by an unpickler that builds only DCP's metadata records: the HMAC
    # above is keyed by the directory's own token, which a received directory brings along.
    md = safe.read_metadata(path)
    _check_shapes(path, md, model, scope)
    return meta


def _agree(ok: bool, step: int, group: dist.ProcessGroup) -> bool:
    """Every rank of the replica checked the same step and found it good (one collective)."""
    t = torch.tensor([int(ok), step, -step], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t[0]) and int(t[1]) == -int(t[2])


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    key: bytes, group: dist.ProcessGroup | None = None, scope: str = "",
                    layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restore model, optimizer and RNG states from `path`; return its manifest (`step`, `extra`).

    With `group`, every rank of the replica calls this with the same path, `scope` and `layout`
    as the save (None: plain; another layout is refused). Gradients are cleared.
    On a `CheckpointError` raised before the DCP read (missing, corrupt, unauthenticated or
    mismatched files; any rank's refusal) nothing was changed.
    """
    path = Path(path)
    err: CheckpointError | None = None
    try:
        meta = _checked(path, model, key, scope, layout)
    except CheckpointError as e:
        err, meta = e, {"step": -1}
    if group is not None and not _agree(err is None, int(meta["step"]), group) and err is None:
        err = CheckpointError(f"checkpoint {path} was refused by another rank of this replica "
                              "(see its log)")
    if err is not None:
        raise err
    # Without state, get_state_dict creates it by a zero step, but only when no gradient is set.
    optimizer.zero_grad(set_to_none=True)
    state = _state_for(model, optimizer, meta["optimizer_state"], scope)
    try:
        _dcp(dcp.load, state, path, group, **safe.load_kwargs(path))
    except (Exception, CheckpointException) as e:
        # CheckpointException derives from BaseException, so `except Exception` alone misses it.
        raise CheckpointError(f"cannot load checkpoint {path}: {_cause(e)}") from None
    own = _unscoped(state, scope)
    if meta["optimizer_state"]:
        set_state_dict(model, optimizer, model_state_dict=own["model"],
                       optim_state_dict=own["optim"])
    else:
        set_model_state_dict(model, own["model"])
        optimizer.state.clear()  # back to "never stepped", exactly as it was saved
    try:
        _set_rng_state(meta["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path} has an invalid RNG state: {_cause(e)}") from None
    return meta
