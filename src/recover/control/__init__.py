"""The control plane: who is in the run, at which generation, and what each step decided.

Public API: `Coordinator` and its `CoordinatorConfig` (the store and the membership, in a process
of their own; `membership.Membership` is its state machine), `Member` (a replica's membership
client: join, heartbeats, generations, fencing) with its `Identity` and `FenceHandlers`,
`CoordinatorLost`, `CoordinatorGone`, `RunOver`, `GlooInterfaceError`, `connect_store`, `try_get`,
`keys` (the one module that spells the store's key layout), `sealed` (values a tokenless process
cannot forge), `session` (the liveness session) and `shards` (the step decision's counts spread
over store shards). Exit codes: `recover.errors.ExitCode`.

Invariant: depends on nothing in recover but `recover.settings`, `recover.errors` and
`recover.deadline`; the communicator (`recover.collectives`) sits on top of it, never below.
"""

from recover.control import keys, shards
from recover.control.coordconfig import CoordinatorConfig
from recover.control.coordinator import Coordinator
from recover.control.keys import connect_store, try_get
from recover.control.member import (
    CoordinatorGone,
    CoordinatorLost,
    FenceHandlers,
    Identity,
    Member,
    RunOver,
)
from recover.control.netif import GlooInterfaceError

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorGone", "CoordinatorLost",
           "FenceHandlers", "GlooInterfaceError", "Identity", "Member", "RunOver", "connect_store",
           "keys", "shards", "try_get"]
