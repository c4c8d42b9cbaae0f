"""recover: resilient LLM pre-training (ReCoVer).

Three protocol layers with one-way dependencies (workload <- recovery -> collectives):
`recover.collectives` (fault-tolerant collectives), `recover.recovery` (in-step recovery) and
`recover.workload` (versatile workload). `recover.app.train` is the reference trainer built on their
public API.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

try:  # the one version: pyproject's, as installed
    __version__ = importlib.metadata.version("recover")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# The user-facing API, imported lazily: `recover train` and `recover simulate` start without
# paying for torch.distributed's DTensor/FSDP2 imports (seconds) until a Replica is needed.
_LAZY = {"Replica": "recover.parallel.replica", "ReplicaFault": "recover.collectives.comm",
         "StepResult": "recover.recovery.step", "ReplicaConfig": "recover.settings",
         "FaultTolerance": "recover.settings", "Numerics": "recover.settings",
         "Hooks": "recover.settings"}
__all__ = ["FaultTolerance", "Hooks", "Numerics", "Replica", "ReplicaConfig", "ReplicaFault",
           "StepResult", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recover' has no attribute {name!r}")
