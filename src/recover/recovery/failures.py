"""The two ways a step ends without a commit, raised by the step engine to its caller.

Invariant: neither is raised while a decision could still commit the step elsewhere without
this rank: `BelowMinReplicas` before this rank computes in a generation that is too small, and
`RecoveryError` only when one of the protocol's bounded waits (a plan, a decision, an admission)
ran out, or after `MAX_ATTEMPTS` attempts.
"""

from __future__ import annotations


class RecoveryError(RuntimeError):
    """A step could not be completed within its bounds."""


class BelowMinReplicas(RuntimeError):
    """Fewer live replicas than the user's minimum: the run must stop (after a checkpoint)."""
