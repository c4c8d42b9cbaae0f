"""Layer 3: versatile workload. Pure functions; no processes, no torch.distributed.

`plan(step, n, members, speeds)` and `reassign(lost_ids, survivors, speeds)` decide who computes
which global microbatch ids; `recover.workload.ids` maps an id to its data and randomness.
"""

from recover.workload.ids import Stream, id_checksum, id_seed, step_ids
from recover.workload.policy import plan, quotas, reassign

__all__ = ["Stream", "id_checksum", "id_seed", "plan", "quotas", "reassign", "step_ids"]
