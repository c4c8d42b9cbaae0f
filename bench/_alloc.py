"""Who allocated what, and when: a ledger of CPU-allocator events from a `torch.profiler` profile.

Invariant: every allocation the profiler recorded (`profile_memory=True`, `with_stack=True`) is
attributed to exactly one owner and one site, fixed at allocation time and kept by its free:
the site is the innermost Python line inside recover's or bench's own files that led to the
allocation (`file:line function`), and the owner is decided from that site by a caller-given
function (e.g. "model" for the model's own gradient, "protocol" for everything recover adds).
A free whose allocation the profile did not see (it predates the profile) is ignored, so live
bytes are those allocated, and not yet freed, while the profile ran.

Only the profiled thread's allocations are recorded (the profiler's memory hook is per thread):
`bench/memory.py` profiles the training thread, where recover makes every buffer of a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Files whose lines are named as sites: recover's sources and the benchmarks. The profiler
# writes file names relative to their sys.path entry ("recover/recovery/step.py"; a bench file,
# whose folder is sys.path[0], bare: "_memrank.py").
ROOTS = ("/recover/", "/bench/")
BENCH = Path(__file__).resolve().parent


@dataclass
class Event:
    t: int  # profiler clock, ns
    size: int  # > 0: allocated; < 0: freed
    ptr: int
    owner: str
    site: str


def _nodes(roots: list[Any]) -> Iterator[Any]:
    stack = list(reversed(roots))
    while stack:  # iterative: a deep Python call tree would overflow recursion
        n = stack.pop()
        yield n
        stack.extend(reversed(n.children))


def _site(node: Any) -> str:
    """The innermost caller line in recover or bench above `node` ("?" if none)."""
    p = node.parent
    while p is not None:
        caller = getattr(p.extra_fields, "caller", None)
        if caller is not None:
            name = "/" + caller.file_name.replace("\\", "/")
            if name.count("/") == 1 and (BENCH / name[1:]).is_file():
                name = "/bench" + name
            cut = max(name.rfind(r) for r in ROOTS)
            if cut >= 0:  # e.g. "recover/recovery/step.py:312 _scratch_buffer"
                return f"{name[cut + 1:]}:{caller.line_number} {caller.function_name}"
        p = p.parent
    return "?"


def ledger(prof: Any, owner_of: Callable[[str], str]) -> tuple[list[Event], dict[str, tuple[int,
                                                                                          int]]]:
    """Time-ordered allocation events of `prof` (allocations and their matched frees), and the
    spans of its `record_function` ranges: name -> (start ns, end ns)."""
    tree = prof.profiler.kineto_results.experimental_event_tree()
    raw: list[tuple[int, int, int, Any]] = []
    spans: dict[str, tuple[int, int]] = {}
    for n in _nodes(tree):
        kind = type(n.extra_fields).__name__
        if kind.endswith("Allocation"):
            raw.append((n.start_time_ns, n.extra_fields.alloc_size, n.extra_fields.ptr, n))
        elif kind.endswith("TorchOp") and n.name.startswith("bench."):
            spans[n.name] = (n.start_time_ns, n.end_time_ns)
    raw.sort(key=lambda e: e[0])
    live: dict[int, Event] = {}
    out: list[Event] = []
    for t, size, ptr, node in raw:
        if size > 0:
            site = _site(node)
            ev = Event(t, size, ptr, owner_of(site), site)
            live[ptr] = ev
            out.append(ev)
        elif size < 0 and ptr in live:
            a = live.pop(ptr)
            out.append(Event(t, size, ptr, a.owner, a.site))
    return out, spans


@dataclass
class Window:
    start: int  # owner's live bytes when the window opened
    peak: int  # the most live at once inside the window
    end: int
    at_peak: dict[str, int]  # "site [when allocated]" -> live bytes, at the peak


def window(events: list[Event], lo: int, hi: int, owner: str,
           when: Callable[[int], str] = lambda t: "") -> Window:
    """Live bytes of `owner` over [lo, hi] (allocations made before lo and still live count).
    `when(t)` names the moment an allocation was made (e.g. which step), for `at_peak`."""
    live: dict[int, Event] = {}
    total, start, peak = 0, None, 0
    at_peak: dict[str, int] = {}

    def snapshot() -> dict[str, int]:
        sites: dict[str, int] = {}
        for e in live.values():
            key = f"{e.site} [{when(e.t)}]" if when(e.t) else e.site
            sites[key] = sites.get(key, 0) + e.size
        return sites

    for e in events:
        if e.t > hi:
            break
        if e.t >= lo and start is None:
            start = peak = total
            at_peak = snapshot()
        if e.owner != owner:
            continue
        if e.size > 0:
            live[e.ptr] = e
        else:
            live.pop(e.ptr, None)
        total += e.size
        if e.t >= lo and total > peak:
            peak, at_peak = total, snapshot()
    if start is None:  # no event inside the window
        start = peak = total
        at_peak = snapshot()
    return Window(start, peak, total, at_peak)
