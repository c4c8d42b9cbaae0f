"""Layer 1: fault-tolerant collectives.

Public API: `Coordinator` and its `CoordinatorConfig` (store + membership, its own process;
`membership.Membership` is its state machine), `Member` (a replica's membership client: join,
heartbeats, generations, fencing) with its `Identity` and `FenceHandlers`, `FaultTolerantComm`
(generation-fenced reduce), `connect` (the one wiring of a member and its communicator),
`ReplicaFault`, `CoordinatorLost`, `CoordinatorGone`, `RunOver`, `GlooInterfaceError`,
`connect_store`, `try_get`, `keys` (the one module that spells the store's key layout), and
`shards` (the step decision's counts spread over store shards). Exit codes:
`recover.errors.ExitCode`.

Invariant: depends on nothing in recover but `recover.settings` and `recover.errors`.
"""

from recover.collectives import keys, shards
from recover.collectives.comm import FaultTolerantComm, ReplicaFault
from recover.collectives.coordconfig import CoordinatorConfig
from recover.collectives.coordinator import Coordinator
from recover.collectives.keys import connect_store, try_get
from recover.collectives.member import (
    CoordinatorGone,
    CoordinatorLost,
    FenceHandlers,
    Identity,
    Member,
    RunOver,
)
from recover.collectives.netif import GlooInterfaceError
from recover.collectives.wiring import connect

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorGone", "CoordinatorLost",
           "FaultTolerantComm", "FenceHandlers", "GlooInterfaceError", "Identity", "Member",
           "ReplicaFault", "RunOver", "connect", "connect_store", "keys", "shards", "try_get"]
