"""Data addressed by microbatch id, for recover's trainer and for users' own loops.

Invariant: everything here is a pure function of (dataset, seed, id): `IdBatches.batch(mb_id)`
reads the same items whoever calls it, so in-step recovery recomputes exactly what was lost, and
`EpochOrder` reads every item once per epoch whatever faults, quotas, restarts or replica counts a
run sees. Nothing here imports the app, the harness or the simulator.

    from recover.data import IdBatches
    data = IdBatches(my_map_style_dataset, microbatch_size=8, seed=0)   # or:
    data = IdBatches.from_prepared("shards/", block_size=256, microbatch_size=8, seed=0)
    x, y = data.batch(mb_id)                       # inside Replica.step's compute(mb_id, j)
"""

from recover.data.batches import SAMPLINGS, IdBatches
from recover.data.order import EpochOrder, permute
from recover.data.tokens import Prepared, TokenWindows, is_prepared, open_prepared, token_dtype

__all__ = ["SAMPLINGS", "EpochOrder", "IdBatches", "Prepared", "TokenWindows", "is_prepared",
           "open_prepared", "permute", "token_dtype"]
