"""recover: resilient LLM pre-training (ReCoVer).

The library: three protocol layers with one-way dependencies (workload <- recovery ->
collectives -> control): `recover.collectives` (fault-tolerant collectives on the control plane,
`recover.control`), `recover.recovery` (in-step recovery) and `recover.workload` (versatile
workload); `recover.replica` (the `Replica` a training loop uses) over `recover.layouts`; every
exception it raises derives from `RecoverError`. `recover.app` (`pip install 'recover[app]'`) is
the reference trainer and its tools, built on the library's public API.
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
_LAZY = {"Replica": "recover.replica.handle", "ReplicaFault": "recover.collectives.comm",
         "StepResult": "recover.recovery.step", "ReplicaConfig": "recover.settings",
         "FaultTolerance": "recover.settings", "Numerics": "recover.settings",
         "Hooks": "recover.settings", "RecoverError": "recover.errors"}
__all__ = ["FaultTolerance", "Hooks", "Numerics", "RecoverError", "Replica", "ReplicaConfig",
           "ReplicaFault", "StepResult", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recover' has no attribute {name!r}")
