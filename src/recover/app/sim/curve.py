"""recover's measured control-plane scale curve, and its extrapolation to a job's size.

Invariant: every per-rank cost the scale scenario charges recover comes from the curve file's
columns through one stated fit per column, evaluated at the size that column is a function of
(`x_of`), except the redone reduce (the step model's all-reduce,
`recover.app.sim.scale`); nothing is
typed in here. A fit never lets a cost fall as the job grows (a negative slope is clamped to 0,
i.e. the mean), and never goes below 0.

The file (written by `bench/scale.py --write-curve`) is JSON: `{"source": "...", "ranks": [...],
"group": [...], "store_ops_per_rank_step": [...], "control_plane_s": [...], "detect_s": [...],
"agree_s": [...], "rebuild_s": [...], "rebuild_cpu_s": [...], "reduce_s": [...]}`, one entry per
measured scale, times in seconds. `ranks` = R x P processes of the job; `group` (optional, default
`ranks`) = the members of each cross-replica group that a failure rebuilds: one per replica, R
(recover builds one such group per position, all in parallel).
- control_plane_s: failure-free, last reduce returns -> commit known on every rank (per step);
- detect_s, agree_s: SIGKILL of one replica -> coordinator's new generation -> survivors agreed;
- rebuild_s, reduce_s: -> the group rebuilt, -> the redone reduce returned (wall clock);
- rebuild_cpu_s: the rebuilding rank's own CPU time over its rebuild (every thread), i.e. its work
  without the wait for a share of the measuring machine's cores;
- control_plane_cpu_s (optional): the most CPU time (every thread) a rank's process spent in
  that span, median over steps: its own control-plane work without the wait for a core;
- store_cpu_s (optional): the store servers' (coordinator's) CPU time for one recovery, less its
  failure-free steps' worth: reported beside the assumptions as a cross-check of the requests
  charged, not charged itself.
- recovery_store_ops_per_rank (optional): the store round trips a failure adds to a survivor's
  step (the most any survivor made, less a failure-free step's), charged per failure on the
  main store (`recover.app.sim.scale.recovery_store_s`) when the next column is absent;
- failure_main_requests_per_rank (optional): every request the main store served because of
  a failure from the ranks' every client, per surviving rank (replicas of one rank), measured
  with `store_shards` shards (an optional number: 0, one store, puts the rendezvous in this
  column); charged per replica's speaker, or per rank without one (`recovery_store_s`);
  failure_main_chain_requests_per_rank (optional, informational): the chain's share of it;
  failure_coordinator_requests (optional): the coordinator's own (the generation's
  publication), per failure;
- failure_shard_requests_per_member (optional): the same on the store shards, where the
  rebuilt communicator's rendezvous goes (barrier, addresses, gloo's address exchange batched:
  O(1) per member, `collectives/meshstore.py`), per member of the rebuilt group
  (`recover.app.sim.scale.rendezvous_store_s`); failure_shard_bytes_per_member (optional): the value
  bytes the shards sent each member meanwhile (gloo's R addresses, O(1) bytes each with pairs
  named by rank: O(R) per member);
- store_request_cpu_s, store_byte_cpu_s (optional, one number each): the store server's CPU time
  per request and per value byte it sends, measured apart (`bench/_store_rate.py`): charged
  (`recover.app.sim.scale.store_serial_s`, `rendezvous_store_s`) as each store server handling its
  ranks' requests one after another.

Each column is a function of one size, `x_of(column)`: the job's ranks (one per GPU) for the
protocol (detect, agree, control plane, store ops: every rank talks to the one coordinator), the
group's members for the communicator (rebuild, reduce: gloo connects the group's full mesh).
Fits (least squares in that size):
- `mixed` (default): the protocol's columns as a + b*log2(x) (O(1) store round trips per rank; a
  crash is seen by one socket closing); the communicator's as a + b*x (each member's rebuild and
  first collective touch every other member), the rendezvous' requests in log2 (see above).
- `log2` / `linear`: every column with that one form (bounds for a sensitivity check).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from recover.errors import ConfigError

DEFAULT_CURVE = Path(__file__).parent / "data" / "scale_curve.json"
COST_COLUMNS = ("control_plane_s", "detect_s", "agree_s", "rebuild_s", "rebuild_cpu_s",
                "reduce_s")
COLUMNS = ("store_ops_per_rank_step", *COST_COLUMNS)
OPTIONAL = ("store_cpu_s", "control_plane_cpu_s", "recovery_store_ops_per_rank",
            "failure_main_requests_per_rank", "failure_main_chain_requests_per_rank",
            "failure_coordinator_requests",
            "failure_shard_requests_per_member", "failure_shard_bytes_per_member")
# Of the group's size (the rest: of the job's ranks)
GROUP_COLUMNS = ("rebuild_s", "rebuild_cpu_s", "reduce_s", "store_cpu_s",
                 "failure_shard_requests_per_member", "failure_shard_bytes_per_member")
MIXED = {
    "store_ops_per_rank_step": "log2",
    "recovery_store_ops_per_rank": "log2",
    "failure_main_requests_per_rank": "log2",  # O(1) per rank: redo, chain, evidence
    "failure_main_chain_requests_per_rank": "log2",  # the chain's share of it
    "failure_coordinator_requests": "log2",  # O(1) per failure
    # gloo's full mesh, its address reads batched (collectives/meshstore.py): O(1) requests per
    # member; R addresses of O(1) bytes each (pairs named by rank: collectives/meshstore.py)
    "failure_shard_requests_per_member": "log2",
    "failure_shard_bytes_per_member": "linear",
    "control_plane_s": "log2",
    "control_plane_cpu_s": "log2",
    "detect_s": "log2",
    "agree_s": "log2",
    "rebuild_s": "linear",
    "rebuild_cpu_s": "linear",
    "reduce_s": "linear",
}
FIT_MODES = ("mixed", "log2", "linear")


@dataclass(frozen=True)
class Fit:
    """y = a + b * x, x = log2(ranks) (`log2`) or ranks (`linear`); never below 0."""

    kind: str
    a: float
    b: float

    def __call__(self, ranks: float) -> float:
        return max(0.0, self.a + self.b * _x(self.kind, ranks))

    def describe(self) -> str:
        x = "log2(ranks)" if self.kind == "log2" else "ranks"
        return f"{self.a:.4g} + {self.b:.4g}*{x}"


def _x(kind: str, ranks: float) -> float:
    return math.log2(ranks) if kind == "log2" else float(ranks)


def fit(ranks: list[int], ys: list[float], kind: str) -> Fit:
    """Least-squares line of `ys` over log2(ranks) or ranks; slope clamped at >= 0."""
    xs = [_x(kind, r) for r in ranks]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    if b < 0:  # a cost that falls with size is noise; hold its mean instead
        b = 0.0
    return Fit(kind, my - b * mx, b)


@dataclass(frozen=True)
class ScaleCurve:
    """The measured columns by scale, and where they came from."""

    path: str
    source: str
    ranks: list[int]
    values: dict[str, list[float]]
    group: list[int] | None = None  # None: = ranks (one rank per replica)
    request_cpu_s: float | None = None  # the store server's CPU per request (None: not measured)
    store_shards: int | None = None  # the shards the measurement ran with (None: not said)
    byte_cpu_s: float | None = None  # its CPU per value byte sent (None: not measured)

    def sizes(self, column: str) -> list[int]:
        """The x of `column`'s measurements (see `x_of`)."""
        return (self.group or self.ranks) if x_of(column) == "group" else self.ranks

    def fits(self, mode: str = "mixed") -> dict[str, Fit]:
        cols = [c for c in (*COLUMNS, *OPTIONAL) if c in self.values and c in MIXED]
        kinds = MIXED if mode == "mixed" else dict.fromkeys(cols, mode)
        return {c: fit(self.sizes(c), self.values[c], kinds[c]) for c in cols}


def x_of(column: str) -> str:
    """What a column's fit is a function of: "group" (members) or "ranks" (the job's)."""
    return "group" if column in GROUP_COLUMNS else "ranks"


def load_curve(path: str | Path | None = None) -> ScaleCurve:
    """Read and check a curve file (default: the one shipped in `recover/app/sim/data`)."""
    p = Path(path) if path is not None else DEFAULT_CURVE
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read scale curve {p}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"scale curve {p} is not valid JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"scale curve {p}: expected a JSON object")
    missing = [k for k in ("ranks", *COLUMNS) if k not in doc]
    if missing:
        raise ConfigError(f"scale curve {p}: missing {', '.join(missing)}")
    ranks = doc["ranks"]
    if (
        not isinstance(ranks, list)
        or not ranks
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks)
        or sorted(set(ranks)) != ranks
    ):
        raise ConfigError(f"scale curve {p}: ranks must be increasing integers >= 1")
    values: dict[str, list[float]] = {}
    for c in (*COLUMNS, *(o for o in OPTIONAL if o in doc)):
        col = doc[c]
        if not isinstance(col, list) or len(col) != len(ranks):
            raise ConfigError(f"scale curve {p}: {c} must list one value per entry of ranks")
        for v in col:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok or not math.isfinite(v) or v < 0:
                raise ConfigError(f"scale curve {p}: {c} values must be finite and >= 0, got {v!r}")
        values[c] = [float(v) for v in col]
    group = doc.get("group")
    if group is not None and (
        not isinstance(group, list)
        or len(group) != len(ranks)
        or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in group)
    ):
        raise ConfigError(f"scale curve {p}: group must list one integer >= 1 per entry of ranks")
    req, per_byte = doc.get("store_request_cpu_s"), doc.get("store_byte_cpu_s")
    for name, v in (("store_request_cpu_s", req), ("store_byte_cpu_s", per_byte)):
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                              or not math.isfinite(v) or v < 0):
            raise ConfigError(f"scale curve {p}: {name} must be a number >= 0")
    shards = doc.get("store_shards")
    if shards is not None and (not isinstance(shards, int) or isinstance(shards, bool)
                               or shards < 0):
        raise ConfigError(f"scale curve {p}: store_shards must be an integer >= 0")
    source = str(doc.get("source") or "(the file names no source)")
    return ScaleCurve(str(p), source, list(ranks), values, group,
                      None if req is None else float(req), shards,
                      None if per_byte is None else float(per_byte))
