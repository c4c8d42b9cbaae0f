"""Layer 2: in-step recovery (uses layer 1 for the reduction and layer 3 for the plan).

Public API: `StepEngine` (one replica's side of a step), `StepResult`, `BelowMinReplicas`,
`RecoveryError`.
"""

from recover.recovery.step import BelowMinReplicas, RecoveryError, StepEngine, StepResult

__all__ = ["BelowMinReplicas", "RecoveryError", "StepEngine", "StepResult"]
