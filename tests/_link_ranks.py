"""Two ranks of one replica exchanging through `replica.link.IntraReplicaLink` over a real gloo
default group: the processes of tests/test_speaker.py.

Forked by that test as `main([OUT, PORT, RANK])` (the session's spawner: torch already imported).
Rank 0 speaks: an agreement both ways, a decision (a code: one broadcast), a chain entry of
~11 kB (any other bytes: its length, then the bytes), then `SPEAKER_LOST`; what each call
returned or raised on this rank goes to OUT/rank{RANK}.json.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from recover.control import CoordinatorLost, keys
from recover.recovery import SPEAKER_LOST
from recover.replica.link import IntraReplicaLink

ENTRY = json.dumps({"gen": 3, "assign": {"0": list(range(1500)), "2": list(range(1500, 3000))}})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out, port, rank = Path(argv[0]), int(argv[1]), int(argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    member: Any = SimpleNamespace(watch=SimpleNamespace(progress=lambda: None))
    link = IntraReplicaLink(member, torch.device("cpu"), 20.0, contextlib.nullcontext)
    speaker = rank == 0
    got: dict[str, Any] = {"agree": link.agree(3, True), "disagree": link.agree(3, speaker),
                           "decision": link.share(keys.COMMIT if speaker else None).decode(),
                           "entry": link.share(ENTRY.encode() if speaker else None).decode()}
    try:
        link.share(SPEAKER_LOST if speaker else None)
        got["lost"] = "returned"
    except CoordinatorLost as e:
        got["lost"] = str(e)
    (out / f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()
    return 0
