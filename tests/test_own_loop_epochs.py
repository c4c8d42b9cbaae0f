"""`Replica.epochs` (`recover.replica.epochs.Epochs`): an epoch-style loop over id-addressed
steps, and the port it makes short: examples/plain.py differs from its DDP original,
examples/ddp_original.py, by at most 30 changed lines, the figure docs/porting.md states.

The loop's logic is checked on a stand-in replica (no process): every step once, in order, in
the epoch of its first item, from a joiner's step on, after a caught `Resumed` from the step the
state holds, and the watchdog paused after each epoch's last step. examples/plain.py runs it on a
real `Replica` through a kill and a restart (tests/test_own_loop_plain_example.py).
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from recover.replica.epochs import Epochs

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
MAX_CHANGED = 30  # issue 51's acceptance


class FakeReplica:
    """What `Epochs` reads of a `Replica`: N, its data, its cursor; `step` moves the cursor."""

    def __init__(self, n: int, items: int, microbatch_size: int, next_step: int = 0) -> None:
        self.n, self.next_step, self.steps_taken = n, next_step, 0
        self.data = SimpleNamespace(dataset=range(items), microbatch_size=microbatch_size)
        self.paused: list[int] = []  # next_step at each pause_watchdog

    def step(self, step: int, resumed_at: int | None = None) -> None:
        self.steps_taken += 1
        self.next_step = step + 1 if resumed_at is None else resumed_at

    def pause_watchdog(self) -> None:
        self.paused.append(self.next_step)


def _run(rep: FakeReplica, count: int, **kw: int) -> list[tuple[int, int]]:
    seen = []
    for epoch, steps in Epochs(rep, count, **kw):  # type: ignore[arg-type]
        for step in steps:
            seen.append((epoch, step))
            rep.step(step)
    return seen


def test_every_step_once_in_the_epoch_of_its_first_item() -> None:
    # 100 items, 3 microbatches of 4 a step: 12 items a step; epoch e's steps are those whose
    # first item i = 12 s has 100 e <= i < 100 (e + 1)
    rep = FakeReplica(n=3, items=100, microbatch_size=4)
    seen = _run(rep, 3)
    assert [s for _, s in seen] == list(range(25))
    assert all(100 * e <= 12 * s < 100 * (e + 1) for e, s in seen), seen
    assert rep.paused == [9, 17, 25]  # after each epoch's last step, before the next one's first
    # given steps_per_epoch (no data), and with it overriding the data's
    rep = FakeReplica(n=3, items=100, microbatch_size=4)
    assert _run(rep, 2, steps_per_epoch=4) == [(e, s) for s in range(8) for e in [s // 4]]


def test_epoch_of_and_epoch_steps_agree_for_any_sizes() -> None:
    """Every step lies in the range of its own epoch, and the ranges tile the steps (sizes where
    a step spans several epochs included: then some epochs hold no step)."""
    for items, b, n in [(100, 4, 3), (10, 16, 4), (65536, 16, 4), (7, 1, 7), (13, 5, 2)]:
        ep = Epochs(FakeReplica(n=n, items=items, microbatch_size=b), 50)  # type: ignore[arg-type]
        tiled = [s for e in range(50) for s in ep.epoch_steps(e)]
        assert tiled == list(range(len(tiled))), (items, b, n)
        assert all(s in ep.epoch_steps(ep.epoch_of(s)) for s in tiled), (items, b, n)


def test_a_joiner_starts_at_its_step_in_its_epoch() -> None:
    rep = FakeReplica(n=3, items=100, microbatch_size=4, next_step=10)  # start_step 10
    seen = _run(rep, 3)
    assert seen == [(1, s) for s in range(10, 17)] + [(2, s) for s in range(17, 25)]
    rep = FakeReplica(n=3, items=100, microbatch_size=4, next_step=25)  # joined at the end
    assert _run(rep, 3) == []


def test_after_a_caught_resumed_the_steps_go_on_where_the_state_is() -> None:
    rep = FakeReplica(n=1, items=10, microbatch_size=1)
    seen = []
    for _, steps in Epochs(rep, 1):  # type: ignore[arg-type]
        for step in steps:
            seen.append(step)
            if step == 4 and seen.count(4) == 1:
                rep.step(step, resumed_at=4)  # one step behind: step 4 again
            elif step == 6:
                rep.step(step, resumed_at=8)  # one ahead: 7 is in the state already
            elif step != 2:  # the body skips rep.step at step 2: the next step is still 3
                rep.step(step)
    assert seen == [0, 1, 2, 3, 4, 4, 5, 6, 8, 9]


def test_bad_arguments_are_one_clear_error() -> None:
    rep = FakeReplica(n=2, items=10, microbatch_size=1)
    with pytest.raises(ValueError, match="must be >= 0"):
        Epochs(rep, -1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps_per_epoch must be >= 1"):
        Epochs(rep, 1, steps_per_epoch=0)  # type: ignore[arg-type]
    rep.data = None  # type: ignore[assignment]
    with pytest.raises(ValueError, match="data=IdBatches"):
        Epochs(rep, 1)  # type: ignore[arg-type]


def _changed_lines(a: Path, b: Path) -> int:
    """`diff -u a b | grep -c '^[+-][^+-]'` (difflib's unified diff where there is no diff)."""
    if shutil.which("diff"):
        out = subprocess.run(["diff", "-u", str(a), str(b)], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()
    else:
        out = list(difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines()))
    return sum(1 for line in out if re.match(r"^[+-][^+-]", line))


def test_the_port_differs_from_its_ddp_original_by_at_most_30_lines_as_documented() -> None:
    original, port = ROOT / "examples" / "ddp_original.py", ROOT / "examples" / "plain.py"
    changed = _changed_lines(original, port)
    assert 0 < changed <= MAX_CHANGED, changed
    assert "DistributedDataParallel" in original.read_text()  # the original is DDP code
    doc = (ROOT / "docs" / "porting.md").read_text()
    stated = [int(a or b) for a, b in re.findall(r"changes (\d+) lines|(\d+) changed\s+lines",
                                                  doc)]
    assert stated and all(n == changed for n in stated), \
        f"docs/porting.md states {stated}; the files differ by {changed}"
    for f in (original, port):  # the page's before and after are the files' code
        text = f.read_text()
        assert text[text.index("from __future__"):] in doc, f"docs/porting.md: not {f.name}'s"
