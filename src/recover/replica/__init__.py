"""The public `Replica` a training loop uses, for any layout, and how a replica grows back.

Public API: `Replica` (`recover.replica.handle`: join, `step`, `clip_grad_norm_`, `leave`;
`epochs`: an epoch-style loop over its steps, `Epochs`); `connect_rank`, `RankStack`,
`new_member` (`recover.replica.rank`: the one wiring of a rank's member, communicator and step
engine). Inside: `connection` (the rank's coordinator connection: join, adopt, a restarted
coordinator rejoined), `leaving` (SIGTERM as a planned leave), `coords` (a rank's place in its
mesh: norms, tied parameters), `invariant` (what `Replica` enforces of the invariant for an own
loop: per-id RNG, one run), `digest` (the parameters' proof on every step), `rejoin`, `transfer`
and `channel` (a joiner's state, streamed from a donor that holds the run token), `link` (a
multi-rank replica's agreement inside itself).

Invariant: whatever `recover train` needs to stay on the failure-free trajectory is done here,
so an own loop on `Replica` gets it too; nothing here imports the app.

Names are imported lazily: `import recover` stays cheap until a `Replica` is needed.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"Replica": "handle", "Epochs": "epochs", "RankStack": "rank", "connect_rank": "rank",
         "new_member": "rank"}

__all__ = ["Epochs", "RankStack", "Replica", "connect_rank", "new_member"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"recover.replica.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'recover.replica' has no attribute {name!r}")
