"""Layer 1: fault-tolerant collectives, on the control plane (`recover.control`).

Public API: `FaultTolerantComm` (the generation-fenced reduction: it never hangs, never crashes
the survivors, never hands out a partial sum), `ReplicaFault` (what a failed reduction raises),
`connect` (the one wiring of a member and its communicator); `tree` (a small payload's
all-reduce), `sever` (ending a gloo operation that waits on a hung peer), `reaper` (releasing a
communicator off the thread that drops it), `meshstore` (a generation's communicator built on the
store).

Invariant: depends on nothing in recover but `recover.control`, `recover.settings`,
`recover.errors` and `recover.deadline`.
"""

from recover.collectives.comm import FaultTolerantComm, ReplicaFault
from recover.collectives.wiring import connect

__all__ = ["FaultTolerantComm", "ReplicaFault", "connect"]
