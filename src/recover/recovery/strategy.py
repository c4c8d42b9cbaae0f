"""What a step does about lost replicas: the strategy the step engine calls through.

The engine (`recover.recovery.step`) owns the protocol: the ownership chain in the store, the
reduce, the verified trailer and the once-written commit decision. A strategy only answers four
questions, as pure functions of the agreed chain, so every replica answers them alike:

- `assign`: who owns which ids in a new chain entry (entry 0: the plan; later: after a loss);
- `keeps_work`: do microbatches computed before a loss still count (recover: yes; a strategy
  that discards an attempt makes every survivor start the step over);
- `owners`: id -> replica that computes it, read from the chain; the reduced sum must hold exactly
  these ids (the engine verifies count and checksum against them);
- `scale`: the factor the reduced sum is multiplied by at commit (the trainer scales each
  microbatch by 1/N, so a strategy that reduces fewer than N ids rescales).

Invariant: `owners(chain)` names one live owner per id of the newest entry's generation, and
`assign` is deterministic in its inputs (the entry is written once and read by everyone).
"""

from __future__ import annotations

from typing import Protocol

from recover.workload import plan, reassign, step_ids

Chain = list[dict]  # entries {"gen": g, "assign": {"replica": [ids]}}, as stored


class StepStrategy(Protocol):
    keeps_work: bool

    def assign(self, step: int, n: int, chain: Chain, members: list[int],
               speeds: dict[int, float] | None) -> dict[int, list[int]]:
        """Ids each member owns in the chain's next entry (`chain` is what precedes it)."""
        ...

    def owners(self, chain: Chain) -> dict[int, int]:
        """id -> owning replica, as the chain stands."""
        ...

    def scale(self, count: int, n: int) -> float:
        """Factor applied to the reduced sum of `count` microbatches each scaled by 1/n."""
        ...


def chain_owners(chain: Chain) -> dict[int, int]:
    """Owners after every entry: a later entry overrides the owner of the ids it hands out."""
    owners: dict[int, int] = {}
    for e in chain:
        for m, ids in e["assign"].items():
            for i in ids:
                owners[i] = int(m)
    return owners


class InStepRecovery:
    """recover's strategy: the step keeps its N ids; a lost replica's ids go to the survivors,
    who keep what they computed and recompute only those (`reassign`, speed-aware)."""

    keeps_work = True

    def assign(self, step: int, n: int, chain: Chain, members: list[int],
               speeds: dict[int, float] | None) -> dict[int, list[int]]:
        if not chain:
            return plan(step, n, members, speeds)
        # Ids whose owner is gone, or that nobody owns yet (the step paused for a joiner).
        owners = chain_owners(chain)
        lost = [i for i in step_ids(step, n) if owners.get(i) not in members]
        return reassign(lost, members, speeds) if lost else {}

    def owners(self, chain: Chain) -> dict[int, int]:
        return chain_owners(chain)

    def scale(self, count: int, n: int) -> float:
        return 1.0
