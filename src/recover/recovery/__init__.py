"""Layer 2: in-step recovery (uses layer 1 for the reduction and layer 3 for the plan).

Public API: `StepEngine` (one replica's side of a step), `StepResult`, `GradAccess`, `TensorGrad`,
`ExactGrads` and `ExactOverflow` (exact mode), `BelowMinReplicas`, `RecoveryError`, `CommitRefused`,
`REDUCE_DTYPES` (the names of `Numerics.reduce_dtype`), `ReplicaLink` (a multi-rank replica's
agreement, for its speaker) with the codes a speaker shares when it raised (`SPEAKER_FAILED`,
`SPEAKER_LOST`; read by `from_speaker`), and the strategy interface `StepStrategy` with recover's
own `InStepRecovery` and the helper `chain_owners` (for other strategies).
Modules: `step` (the step loop), `chain` (the ownership chain), `decide` (the commit decision),
`speaker` (a multi-rank replica's one voice to the store, `ReplicaLink`), `lifetime` (deleting the
keys of old steps), `trailer` (the reduce's verification), `buckets` (the reduce overlapped with the
last backward), `grads`, `exact`, `strategy`, `shrink`.
"""

from recover.recovery.exact import ExactGrads, ExactOverflow
from recover.recovery.failures import BelowMinReplicas, CommitRefused, RecoveryError
from recover.recovery.grads import GradAccess, TensorGrad
from recover.recovery.speaker import SPEAKER_FAILED, SPEAKER_LOST, ReplicaLink, from_speaker
from recover.recovery.step import MAX_ATTEMPTS, REDUCE_DTYPES, StepEngine, StepResult
from recover.recovery.strategy import Chain, InStepRecovery, StepStrategy, chain_owners

__all__ = ["MAX_ATTEMPTS", "REDUCE_DTYPES", "SPEAKER_FAILED", "SPEAKER_LOST", "BelowMinReplicas",
           "Chain", "CommitRefused", "ExactGrads", "ExactOverflow", "GradAccess", "InStepRecovery",
           "RecoveryError", "ReplicaLink", "StepEngine", "StepResult", "StepStrategy",
           "TensorGrad", "chain_owners", "from_speaker"]
