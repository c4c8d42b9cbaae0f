"""What a run's metrics writers wrote, read back with each tool's own reader (tests, reports).

Invariant: nothing here writes; TensorBoard event files are read with tensorboard's own
`EventAccumulator`, a W&B offline run's `.wandb` file with wandb's own protobuf `Record` (the file
is wandb's LevelDB-style record log: a 7-byte header, then 32 KiB blocks of 7-byte-headed
chunks), so a test checks what those tools themselves will show.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024  # the LevelDB log format's block
FULL, LAST = 1, 4  # its chunk types that end a record (FIRST = 2, MIDDLE = 3 continue one)


def tensorboard(folder: Path) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, str]]]:
    """(scalars, texts) of a TensorBoard folder: tag -> {step: value}; a text's tag as given to
    `add_text` (without TensorBoard's `/text_summary` suffix)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    texts = {t.removesuffix("/text_summary"): {e.step: e.tensor_proto.string_val[0].decode()
                                               for e in acc.Tensors(t)}
             for t in acc.Tags()["tensors"] if t.endswith("/text_summary")}
    return scalars, texts


def wandb_records(path: Path) -> Iterator[Any]:
    """Every record of a `.wandb` file, as wandb's protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a .wandb file")
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            yield rec


def wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """An offline W&B run's history: step -> {key: value} (wandb's own `_step`)."""
    (path,) = run_dir.glob("*.wandb")
    out: dict[int, dict[str, Any]] = {}
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in rec.history.item}
            out.setdefault(int(row["_step"]), {}).update(row)
    return out


def wandb_config(run_dir: Path) -> dict[str, Any]:
    """The config an offline W&B run was started with (its `run` record)."""
    (path,) = run_dir.glob("*.wandb")
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") == "run":
            return {u.key: json.loads(u.value_json) for u in rec.run.config.update}
    return {}
