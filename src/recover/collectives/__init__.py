"""Layer 1: fault-tolerant collectives.

Public API: `Coordinator` (store + membership, its own process), `Member` (a replica's membership
client: join, heartbeats, generations, fencing), `FaultTolerantComm` (generation-fenced reduce),
`ReplicaFault`, `CoordinatorLost`, `GlooInterfaceError`, `EXIT_FENCED`, `EXIT_PARTITIONED`,
`connect_store`, `try_get`, `keys` (the one module that spells the store's key layout), and
`shards` (the step decision's counts spread over store shards).
Depends on nothing else in recover.
"""

from recover.collectives import keys, shards
from recover.collectives.comm import FaultTolerantComm, GlooInterfaceError, ReplicaFault
from recover.collectives.coordinator import Coordinator
from recover.collectives.keys import EXIT_FENCED, EXIT_PARTITIONED, connect_store, try_get
from recover.collectives.member import CoordinatorGone, CoordinatorLost, Member

__all__ = ["Coordinator", "CoordinatorGone", "CoordinatorLost", "EXIT_FENCED", "EXIT_PARTITIONED",
           "FaultTolerantComm", "GlooInterfaceError", "Member", "ReplicaFault", "connect_store",
           "keys", "shards", "try_get"]
