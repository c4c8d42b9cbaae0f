"""gloo's ring all-reduce against recover's tree (`recover.collectives.tree`), side by side.

What: the CPU (every thread of the process) and the wall time one member spends in one
all-reduce of a float32 payload, through gloo's `allreduce` (its ring: 2(R - 1) steps) and
through `TreeDriver` (up and down a binary tree of point-to-point ops, on its own thread: what
`FaultTolerantComm` runs for a payload up to `TREE_MAX_BYTES`), at each group size R and payload
size. R processes, one gloo group on a FileStore, one intra-op thread each; per (R, size) the two
ways alternate in rounds (ring, tree, ring, tree, ...), so the machine's drift hits both alike.
Per way: the median over the ops of each member, then the most any member spent (the figure a
recovery's busiest survivor pays) and the mean member.

Last lines: `ring_cpu_growth=` and `tree_cpu_growth=` (the busiest member's CPU per op of the
smallest payload at the largest R over the smallest R), then `tree_vs_ring_cpu=` (tree over
ring, the same payload at the largest R).

    python bench/tree.py --smoke     # R = 2, 4; 1,024 floats: seconds (CI)
    python bench/tree.py --quick     # R = 4, 16, 64; 1,024 / 131,072 / 1,048,576 floats: ~2 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import bench_args, defaults, loadavg, out_dir, say, table

log = logging.getLogger("bench.tree")

MEMBER_TIMEOUT_S = 120.0  # one member's whole run at one R (start-up included)


def member(rank: int, size: int, store_path: str, sizes: list[int], ops: int, rounds: int,
           timeout_s: float) -> dict:
    """One member's medians per payload size and way, in ms: {numel: {way: [cpu, wall]}}."""
    import torch
    from torch.distributed import FileStore, ProcessGroupGloo

    from recover.collectives.tree import TreeDriver

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(FileStore(store_path, size), rank, size,
                          datetime.timedelta(seconds=timeout_s))
    tree = TreeDriver(pg, rank, size, timeout_s, "bench-tree")
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for numel in sizes:
            t = torch.empty(numel)
            runs: dict[str, list[tuple[float, float]]] = {"ring": [], "tree": []}
            for _ in range(rounds):
                for way in ("ring", "tree"):
                    for i in range(ops + 1):  # the first of each batch untimed (a warm-up)
                        t.fill_(float(rank + 1))
                        c0, w0 = time.process_time(), time.perf_counter()
                        if way == "ring":
                            pg.allreduce([t]).wait(datetime.timedelta(seconds=timeout_s))
                        else:
                            tree.submit(t)[0].wait()
                        c1, w1 = time.process_time(), time.perf_counter()
                        if float(t[0]) != size * (size + 1) / 2:  # the full sum, or the figure lies
                            raise RuntimeError(f"{way}: {float(t[0])} is not the full sum")
                        if i:
                            runs[way].append((c1 - c0, w1 - w0))
            out[str(numel)] = {w: [1e3 * statistics.median(x[0] for x in r),
                                   1e3 * statistics.median(x[1] for x in r)]
                               for w, r in runs.items()}
    finally:
        tree.close(wait_s=timeout_s)
    return out


def run_size(size: int, sizes: list[int], a: argparse.Namespace, out: Path) -> list[dict]:
    """R member processes, to their end or MEMBER_TIMEOUT_S (then ended by PID)."""
    store = out / f"store.{size}"
    store.unlink(missing_ok=True)
    procs, files = [], []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        for r in range(size):
            f = out / f"member.{size}.{r}.json"
            f.unlink(missing_ok=True)
            files.append(f)
            cmd = [sys.executable, __file__, "--member", str(r), str(size), str(store), str(f),
                   "--sizes", ",".join(map(str, sizes)), "--ops", str(a.ops),
                   "--rounds", str(a.rounds)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
        deadline = time.monotonic() + MEMBER_TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"tree bench: R={size} did not end within {MEMBER_TIMEOUT_S:.0f}s "
                         "(its members were ended)") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by its PID (Popen's own)
                p.wait(5)
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise SystemExit(f"tree bench: members {bad} of {size} failed (exit codes "
                         f"{[procs[r].returncode for r in bad]})")
    return [json.loads(f.read_text()) for f in files]


def main() -> None:
    ap = bench_args(__doc__, "R = 4, 16, 64; three payload sizes", "R = 2, 4; one size")
    ap.add_argument("--ranks", help="comma-separated group sizes R (default by mode)")
    ap.add_argument("--sizes", help="comma-separated payloads in float32 (default by mode)")
    ap.add_argument("--ops", type=int, help="timed ops per way per round")
    ap.add_argument("--rounds", type=int, help="rounds of (ring, tree)")
    ap.add_argument("--member", nargs=4, metavar=("RANK", "R", "STORE", "OUT"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    defaults(a, {"ranks": {"smoke": "2,4", "quick": "4,16,64", "full": "4,16,64,128"}[mode],
                 "sizes": {"smoke": "1024", "quick": "1024,131072,1048576",
                           "full": "1024,131072,1048576"}[mode],
                 "ops": {"smoke": 5, "quick": 10, "full": 20}[mode],
                 "rounds": {"smoke": 2, "quick": 3, "full": 4}[mode]})
    sizes = [int(x) for x in a.sizes.split(",")]
    if a.member:
        rank, size, store, dest = a.member
        res = member(int(rank), int(size), store, sizes, a.ops, a.rounds, MEMBER_TIMEOUT_S / 2)
        Path(dest).write_text(json.dumps(res))
        sys.stdout.flush()
        os._exit(0)  # no gloo teardown at exit (docs/DESIGN.md, "Membership and faults")
    out = out_dir(a.out, "tree")
    ranks = [int(x) for x in a.ranks.split(",")]
    say(f"tree: gloo's ring all-reduce vs recover's tree, R in {ranks}, payloads {sizes} "
        f"float32; {a.rounds} rounds x {a.ops} ops per way; load average {loadavg():.1f} on "
        f"{os.cpu_count()} core(s); out {out}")
    rows, busiest = [], {}
    for size in ranks:
        t0 = time.monotonic()
        res = run_size(size, sizes, a, out)
        log.info("R=%d: %d members in %.0fs, load %.1f", size, size, time.monotonic() - t0,
                 loadavg())
        for numel in sizes:
            k = str(numel)
            per = {w: ([m[k][w][0] for m in res], [m[k][w][1] for m in res])
                   for w in ("ring", "tree")}
            busiest[size, numel] = {w: max(per[w][0]) for w in per}
            rows.append((size, numel, *(f"{max(per[w][0]):.3f}" for w in per),
                         *(f"{statistics.mean(per[w][0]):.3f}" for w in per),
                         *(f"{statistics.median(per[w][1]):.3f}" for w in per)))
    table(rows, ("R", "floats", "ring_cpu_max", "tree_cpu_max", "ring_cpu_mean",
                 "tree_cpu_mean", "ring_wall", "tree_wall"))
    say("  ms per op: *_cpu_max the busiest member's median CPU (all its threads), *_cpu_mean "
        "the mean member's, *_wall the median member's median wall time")
    lo, hi, small = min(ranks), max(ranks), min(sizes)
    for way in ("ring", "tree"):
        say(f"{way}_cpu_growth={busiest[hi, small][way] / busiest[lo, small][way]:.2f}")
    say(f"tree_vs_ring_cpu={busiest[hi, small]['tree'] / busiest[hi, small]['ring']:.3f}")


if __name__ == "__main__":
    main()
