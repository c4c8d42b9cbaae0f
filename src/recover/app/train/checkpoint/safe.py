"""Reading a checkpoint's DCP files without running code that whoever wrote them chose.

Invariant: nothing recover reads from a checkpoint is unpickled by the general unpickler. DCP's
`.metadata` is a pickle: it is read by `SafeUnpickler`, which builds only the classes a DCP
metadata holds (`ALLOWED`: torch.distributed.checkpoint's metadata records, `torch.Size`, torch
dtypes and layouts, a path, plain containers) and refuses any other global, unbuilt, as one
`CheckpointError` line naming it; a checkpoint's non-tensor entries (the optimizer's
hyper-parameters) are read with `torch.load(weights_only=True)` (`SafeLoadPlanner`), tensors by
DCP as raw bytes. Why: the manifest's HMAC is keyed by the run directory's own `run.token`, so it
proves only that the directory is whole, never who wrote it: a received run directory (copied,
downloaded) carries its own token, and `recover sample`, `recover export` and `--resume` must be
safe to point at it. This module imports DCP (seconds of CPU cold: docs/MEASUREMENTS.md, "Threads
and start-up"): only readers import it.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import default_planner as _planner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from recover.errors import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) a DCP `.metadata` pickle may name: records and constants, none with side effects
# when built or called (an Enum looked up by value, a layout looked up by name).
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA, n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
    ("builtins", "slice"), ("builtins", "bytearray"),
})


class Refused(pickle.UnpicklingError):
    """A pickle named a global outside `ALLOWED` (nothing of it was built)."""


class SafeUnpickler(pickle.Unpickler):
    """Builds only what `ALLOWED` names, and torch's dtypes (`torch.float32`, ...)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in ALLOWED:
            raise Refused(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint at `path` (its `.metadata`), read by `SafeUnpickler`; a
    one-line `CheckpointError` for one that names anything else or does not unpickle."""
    path = Path(path)
    try:
        with open(path / ".metadata", "rb") as f:
            md = SafeUnpickler(f).load()
    except Refused as e:
        raise CheckpointError(f"checkpoint {path}: its DCP metadata (a pickle) names {e}, which "
                              "no checkpoint holds: refused, nothing of it run or loaded") from None
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, RecursionError, MemoryError) as e:
        raise CheckpointError(f"checkpoint {path} has unreadable DCP metadata: "
                              f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"checkpoint {path}: its DCP metadata is a {type(md).__name__}, "
                              "not DCP's Metadata")
    return md


class SafeReader(FileSystemReader):
    """DCP's file-system reader, with `.metadata` read by `SafeUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:  # a per-rank metadata file: no checkpoint of recover writes one
            raise CheckpointError(f"checkpoint {self.path}: per-rank DCP metadata is not read")
        md = read_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor entry is read with `weights_only=True`
    (plain values, containers and tensors only: DCP's own reads them with the general
    unpickler)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            fqn = read_item.dest_index.fqn
            raise CheckpointError(f"a checkpoint's entry {fqn} is not plain data (it would run "
                                  f"code to load): {' '.join(str(e).split())[:160]}") from None
        if self.flatten_state_dict:  # as DCP's own load_bytes does, with its own helper
            _planner.set_element(self.original_state_dict,
                                 self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_kwargs(path: Path) -> dict[str, Any]:
    """What `dcp.load` takes to read `path` with neither unpickler: its reader and planner."""
    return {"storage_reader": SafeReader(path), "planner": SafeLoadPlanner()}
