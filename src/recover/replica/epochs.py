"""An epoch-style loop over id-addressed steps: what a loop ported from a `DataLoader` keeps.

Invariant: `Epochs(rep, count)` yields `(epoch, steps)` for the epochs from the one holding the
replica's next step (`Replica.next_step`: 0, or `start_step` for a replica that joined a running
run) to `count - 1`, and `steps` yields step numbers in order: those of the epoch, from the
replica's next step on. A step belongs to the epoch of its first item: step s reads microbatch
ids s*N .. s*N+N-1, of `microbatch_size` items each (`IdBatches`), so epoch e is the steps s with
e*items <= s*N*microbatch_size < (e+1)*items (without data: `steps_per_epoch` steps each). The
steps are a function of the step number and those sizes only: every replica, joined at any
step, iterates the same steps in the same epochs, each once. Nothing is computed or skipped
here: the caller's loop body runs the step (`rep.step(step, compute)`) and its optimizer.

If the body catches `Resumed` (a restarted coordinator resumed the run at another step, and
this replica now holds that state), the next step yielded is the one that state goes on with.

The code after an epoch's last step (a snapshot, an evaluation) runs with the stuck-thread
watchdog paused, as in `rep.busy()`, until the next `rep.step` arms it again: epoch-end work is
the loop's own and may outlast a step; it must be bounded on its own (a save is; every replica
does the same work, so none waits in a reduce on another's evaluation longer than on its own).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recover.replica.handle import Replica


class Epochs:
    """`for epoch, steps in Epochs(rep, count):` then `for step in steps:` (see the module).
    `steps_per_epoch`: the epoch length where the replica was given no `data=IdBatches` (or to
    override it); `len(Epochs)` is `count`, `epoch_steps(e)` the range of epoch e's steps."""

    def __init__(self, rep: Replica, count: int, steps_per_epoch: int | None = None) -> None:
        if count < 0:
            raise ValueError(f"the number of epochs must be >= 0 (got {count})")
        data = getattr(rep, "data", None)
        if steps_per_epoch is None and data is None:
            raise ValueError("Epochs needs the epoch's length: build the Replica with "
                             "data=IdBatches(...), or give steps_per_epoch")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1 (got {steps_per_epoch})")
        self.rep, self.count, self.steps_per_epoch = rep, int(count), steps_per_epoch
        # items per epoch, items per step (IdBatches: every item once per epoch)
        self._items = int(len(data.dataset)) if data is not None else 0
        self._per_step = int(data.microbatch_size) * rep.n if data is not None else 0

    def __len__(self) -> int:
        return self.count

    def first_step(self, epoch: int) -> int:
        """The first step of `epoch` (of the run's steps, from 0)."""
        if self.steps_per_epoch is not None:
            return epoch * self.steps_per_epoch
        return -(-epoch * self._items // self._per_step)  # ceil: the first step reaching it

    def epoch_steps(self, epoch: int) -> range:
        return range(self.first_step(epoch), self.first_step(epoch + 1))

    def epoch_of(self, step: int) -> int:
        """The epoch `step` belongs to (that of its first item)."""
        if self.steps_per_epoch is not None:
            return step // self.steps_per_epoch
        return step * self._per_step // self._items

    def __iter__(self) -> Iterator[tuple[int, Iterator[int]]]:
        epoch = self.epoch_of(self.rep.next_step)
        while epoch < self.count:
            yield epoch, self._steps(self.epoch_steps(epoch))
            epoch += 1

    def _steps(self, span: range) -> Iterator[int]:
        rep = self.rep
        step = max(span.start, rep.next_step)
        while step < span.stop:
            taken = rep.steps_taken
            yield step
            # the body ran rep.step: go on from where the state is (step + 1, or a Resumed's
            # step); it did not: the next one
            step = rep.next_step if rep.steps_taken != taken else step + 1
        # The epoch's end: the loop's own work until the next rep.step (module docstring).
        rep.pause_watchdog()
