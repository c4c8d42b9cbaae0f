"""The ways a step ends without a commit here, raised by the step engine to its caller.

Invariant: none is raised while a decision could still commit the step elsewhere without
this rank: `BelowMinReplicas` before this rank computes in a generation that is too small, and
`RecoveryError` only when one of the protocol's bounded waits (a plan, a decision, an admission)
ran out, or after `MAX_ATTEMPTS` attempts. `CommitRefused` is the exception to "without this
rank": the protocol makes it unreachable, so when it is raised the store was written by someone
outside the protocol (or the protocol has a bug), and this rank ends rather than apply.
"""

from __future__ import annotations

from recover.errors import RecoverError


class RecoveryError(RecoverError, RuntimeError):
    """A step could not be completed within its bounds."""


class BelowMinReplicas(RecoverError, RuntimeError):
    """Fewer live replicas than the user's minimum: the run must stop (after a checkpoint)."""


class CommitRefused(RecoveryError):
    """The attempt's decision says commit, but this rank's own reduce failed or did not verify:
    it holds no verified sum, so applying would be a silent wrong update. The protocol never
    decides so (a rank whose reduce failed never counts); a forged decision key or a future slip
    becomes this loud failure instead."""
