"""The default mode's band, measured: how far runs with faults and runs that lost data fall from
the failure-free reference, in units of the band (`recover.app.verify`), side by side in one run.

What: one configuration (R replicas, N microbatches, S steps): the failure-free reference, the
band's run (the same ids over R-1 replicas, failure-free), runs with kills in several phases
and steps, and runs that silently drop one microbatch of one step (the test-only `drop` fault).
For each run, the largest ratio over the steps of its deviation (relative loss; relative
parameter distance from the digests) to the band's envelope at that step. `verify.MARGIN` must
sit between the two groups: above every faulty run's ratio, far below every dropped run's.
Last lines: `band_fault_ratio_max=`, `band_drop_ratio_min=`, then `band_separation=` (the
second over the first; a margin has room when it is far above 1).

    python bench/band.py --smoke     # R=3, N=7, 8 steps: one faulty run, one drop (CI)
    python bench/band.py --quick     # R=5, N=10, 40 steps: two faulty runs, one drop
    python bench/band.py             # R=5, N=10, 40 steps: four faulty runs, two drops
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from _common import bench_args, out_dir, recover_train, say, table
from recover.app.verify import MARGIN, deviations, envelope, read_lines

log = logging.getLogger("bench.band")
FAULTY = [  # (name, faults) at R=5 (replica ids < 5), steps >= 40
    ("kill-backward-3", ["kill:replica=4,step=3,phase=backward"]),
    ("reduce-20+commit-30", ["kill:replica=1,step=20,phase=reduce",
                             "kill:replica=3,step=30,phase=commit"]),
    ("four-kills", ["kill:replica=0,step=0,phase=forward", "kill:replica=1,step=10,phase=reduce",
                    "kill:replica=2,step=10,phase=backward",
                    "kill:replica=3,step=39,phase=optimizer"]),
    ("hang-5+commit-15", ["hang:replica=2,step=5,seconds=3",
                          "kill:replica=1,step=15,phase=commit"]),
]
DROPS = [("drop-12", ["drop:replica=2,step=12"]),
         ("drop-35", ["drop:replica=2,step=35,microbatch=1"])]
SMOKE_FAULTY = [("kill-backward-2", ["kill:replica=2,step=2,phase=backward"])]
SMOKE_DROPS = [("drop-4", ["drop:replica=1,step=4"])]


def ratio(run: Path, ref: Path, env: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """The largest (loss, parameter) deviation of `run` from `ref` over the band's envelope."""
    dev = deviations(read_lines(run), read_lines(ref))
    return (max(dev[t][0] / env[t][0] for t in dev if t in env),
            max(dev[t][1] / env[t][1] for t in dev if t in env))


def main() -> int:
    ap = bench_args(__doc__, "two faulty runs and one drop", "R=3, N=7, 8 steps")
    a = ap.parse_args()
    root = out_dir(a.out, "band")
    if a.smoke:
        replicas, n, steps, faulty, drops = 3, 7, 8, SMOKE_FAULTY, SMOKE_DROPS
    else:
        replicas, n, steps = 5, 10, 40
        faulty, drops = (FAULTY[1:3], DROPS[:1]) if a.quick else (FAULTY, DROPS)
    base = ["--replicas", str(replicas), "--microbatches", str(n), "--steps", str(steps),
            "--eval-every", "0", "--no-report"]

    def train(name: str, extra: list[str]) -> Path:
        log.info("running %s", name)
        recover_train(root / name, "debug", base + extra, timeout_s=600)
        return root / name

    ref = train("reference", [])
    band_run = train("band", ["--replicas", str(replicas - 1)])
    env = envelope(deviations(read_lines(band_run), read_lines(ref)))
    rows: list[tuple] = []
    fault_max, drop_min = 0.0, float("inf")
    for group, runs in (("faulty", faulty), ("drop", drops)):
        for name, faults in runs:
            r = ratio(train(name, [x for f in faults for x in ("--fault", f)]), ref, env)
            rows.append((group, name, f"{r[0]:.3g}", f"{r[1]:.3g}"))
            if group == "faulty":
                fault_max = max(fault_max, *r)
            else:
                drop_min = min(drop_min, max(r))
    say(f"R={replicas} N={n} steps={steps}; band envelope at the last step: loss "
        f"{env[steps - 1][0]:.3e}, params {env[steps - 1][1]:.3e}; verify.MARGIN={MARGIN:g}")
    table(rows, ("group", "run", "loss / band", "params / band"))
    say(f"band_fault_ratio_max={fault_max:.4g}")
    say(f"band_drop_ratio_min={drop_min:.4g}")
    say(f"band_separation={drop_min / max(fault_max, 1e-12):.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
