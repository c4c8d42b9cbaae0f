"""`recover verify RUN REF`: check a finished run against a failure-free run of the same config,
from their directories alone (no re-run, no parameter files).

Invariant: the verdict reads only what both runs' `metrics.jsonl` lines carry for the steps both
committed (REF may be a shorter failure-free rerun: `--stop-at K`), and it passes only if
- every step of RUN trained on exactly N microbatches (its `microbatches` field), and
- exact mode (both runs `--exact`): every compared step's loss and parameter digest
  (`recover.replica.digest`: random projections, sum of squares, SHA-256) are bitwise equal;
- default mode: every compared step's relative loss deviation and relative parameter distance
  (estimated from the digests) stay within `MARGIN` x the band's envelope at that step, the band
  being what regrouping the same microbatches does to a failure-free run of this configuration
  (`band.json` beside REF, written by `recover train --reference`, or `--band DIR`: a
  failure-free run with another replica count). The envelope at step t is the largest band
  deviation up to t, at least `FLOOR`.
Otherwise exit 1 with one line naming the first failing step. Unreadable input: one line, exit 2.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from recover.app import rundir
from recover.app.config import RunConfig
from recover.app.rundir import CONFIG, METRICS, read_json, read_jsonl
from recover.data.tokens import META as TOKENS_META
from recover.errors import ExitCode, RecoverError, UsageParser, usage_line
from recover.replica.digest import Digest, rel_distance

# A run with faults regroups microbatches at each recovery (and for good after a replica is
# lost), as the band's run does once; how far two such regroupings drift apart is random, so a
# faulty run's deviation is the band's order, not below it. The margin leaves room for that
# spread while one dropped microbatch stays far outside (MEASUREMENTS.md, "The band").
MARGIN = 10.0
# The least envelope: a step where the band's two runs happen to agree bitwise (step 0's loss is
# the same forward on the same weights) still allows a few float32 ulps of another grouping.
FLOOR = 2.0 ** -20


@dataclass
class Line:
    step: int
    loss: float
    microbatches: int
    digest: Digest | None


def read_lines(run: Path) -> dict[int, Line]:
    """The committed steps of a run directory's metrics.jsonl (`rundir.read_jsonl`: a torn line
    is not a step; `verify` fails a run with a gap)."""
    path = run / METRICS
    out: dict[int, Line] = {}
    for rec in read_jsonl(path):
        try:
            line = Line(int(rec["step"]), float(rec["loss"]), int(rec["microbatches"]),
                        Digest.from_json(rec.get("digest")))
        except (KeyError, TypeError, ValueError):
            raise RecoverError(f"{path}: a line that is not a step's record") from None
        out[line.step] = line
    if not out:
        raise RecoverError(f"{path}: no committed step (is {run} a run directory?)")
    return out


def _config(run: Path) -> RunConfig:
    try:
        return RunConfig.load(run / CONFIG)
    except RecoverError:
        raise
    except Exception as e:  # a file that is not a run's config: one line
        raise RecoverError(f"{run / CONFIG}: not a run's config ({e})") from None


def _identity(run: Path, cfg: RunConfig) -> dict:
    """What the trajectory depends on, the data by its content (the hash `prepare_data` keeps in
    DIR/data/meta.json, or the prepared folder's meta), not by the path it was read from: a
    rerun on another machine reads the same tokens from another place."""
    key = cfg.trajectory_key()
    try:
        meta = read_json(run / rundir.DATA / rundir.DATA_META)
    except OSError:  # unreadable: compared by the path the config names
        meta = None
    data = meta.get("sha256") if isinstance(meta, dict) else None
    if data is None and isinstance(meta, dict) and isinstance(meta.get("prepared"), str):
        try:  # the prepared folder's own description, by its bytes (its format: recover.data)
            data = hashlib.sha256((Path(meta["prepared"]) / TOKENS_META).read_bytes()).hexdigest()
        except OSError:
            data = None
    if data is not None and isinstance(key.get("data"), dict):
        key["data"]["path"] = data
    return key


def deviations(run: dict[int, Line], ref: dict[int, Line]) -> dict[int, tuple[float, float]]:
    """Per common step: (relative loss deviation, relative parameter distance; nan without
    digests)."""
    out = {}
    for t in sorted(set(run) & set(ref)):
        a, b = run[t], ref[t]
        loss = abs(a.loss - b.loss) / max(abs(b.loss), 1e-12)
        par = (rel_distance(a.digest, b.digest) if a.digest and b.digest else math.nan)
        out[t] = (loss, par)
    return out


def write_band(ref: Path, band_run: Path) -> dict[int, tuple[float, float]]:
    """Measure the band (REF against a failure-free run that groups the same microbatches
    otherwise) and keep it as REF/band.json."""
    band = deviations(read_lines(band_run), read_lines(ref))
    (ref / rundir.BAND).write_text(json.dumps({
        "from": str(band_run), "margin": MARGIN, "floor": FLOOR,
        "steps": {str(t): list(v) for t, v in band.items()}}) + "\n")
    return band


def read_band(path: Path) -> dict[int, tuple[float, float]]:
    try:
        d = read_json(path)
        return {int(t): (float(v[0]), float(v[1])) for t, v in d["steps"].items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise RecoverError(f"{path}: not a band file (recover train --reference writes one)"
                           ) from None


def envelope(band: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """The largest band deviation up to each step (loss, params), at least FLOOR."""
    out, lo, pa = {}, FLOOR, FLOOR
    for t in sorted(band):
        lo = max(lo, band[t][0])
        pa = max(pa, band[t][1] if not math.isnan(band[t][1]) else 0.0)
        out[t] = (lo, pa)
    return out


@dataclass
class Verdict:
    ok: bool
    lines: list[str]
    failure: str = ""


def verify(run_dir: Path, ref_dir: Path, band_dir: Path | None = None) -> Verdict:
    """The comparison `recover verify` prints (see the module's invariant)."""
    cfg, ref_cfg = _config(run_dir), _config(ref_dir)
    if _identity(run_dir, cfg) != _identity(ref_dir, ref_cfg):
        raise RecoverError(f"{run_dir} and {ref_dir} are runs of different configurations "
                           "(seed, N, model, data, optimizer or steps): nothing to compare")
    n = cfg.data.microbatches
    run, ref = read_lines(run_dir), read_lines(ref_dir)
    common = sorted(set(run) & set(ref))
    if not common:
        raise RecoverError(f"{run_dir} and {ref_dir} have no committed step in common")
    lines = [f"steps: {len(common)} compared ({common[0]}..{common[-1]}); RUN has {len(run)}, "
             f"REF {len(ref)}"]
    gap = next((t for t in range(min(run), max(run) + 1) if t not in run), None)
    if gap is not None:
        return Verdict(False, lines, f"step {gap}: RUN has no line for it (a lost record)")
    wrong_n = [t for t in sorted(run) if run[t].microbatches != n]
    lines.append(f"microbatches: N={n} on every step of RUN" if not wrong_n else
                 f"microbatches: step {wrong_n[0]} trained on {run[wrong_n[0]].microbatches}, "
                 f"not N={n}")
    if wrong_n:
        t = wrong_n[0]
        return Verdict(False, lines, f"step {t} trained on {run[t].microbatches} microbatches, "
                                     f"not N={n}")
    first = next((t for t in common if not _bitwise(run[t], ref[t])), None)
    lines.append("bitwise: equal at every compared step" if first is None else
                 f"bitwise: first difference at step {first}")
    if first is None:  # bitwise everywhere: inside any band
        return Verdict(True, lines)
    if cfg.compute.exact:
        what = "loss" if run[first].loss != ref[first].loss else "parameter digest"
        return Verdict(False, lines, f"step {first}: its {what} differs from REF's (exact mode "
                                     "promises bitwise equality)")
    return _band_verdict(run, ref, ref_dir, band_dir, common, lines)


def _bitwise(a: Line, b: Line) -> bool:
    return a.loss == b.loss and a.digest is not None and a.digest == b.digest


def _band_verdict(run: dict[int, Line], ref: dict[int, Line], ref_dir: Path,
                  band_dir: Path | None, common: list[int], lines: list[str]) -> Verdict:
    if band_dir is not None:
        band = deviations(read_lines(band_dir), ref)
        source = str(band_dir)
    elif (ref_dir / rundir.BAND).exists():
        band, source = read_band(ref_dir / rundir.BAND), str(ref_dir / rundir.BAND)
    else:
        raise RecoverError(f"no band to judge a default-mode run by: {ref_dir / rundir.BAND} is "
                           "missing (recover train --reference writes it); pass --band DIR, a "
                           "failure-free run of this config with another replica count")
    env = envelope(band)
    dev = deviations(run, ref)
    worst_loss = max(dev[t][0] for t in common)
    worst_par = max((dev[t][1] for t in common if not math.isnan(dev[t][1])), default=math.nan)
    band_loss = max(v[0] for v in env.values())
    band_par = max(v[1] for v in env.values())
    lines.append(f"deviation: loss {worst_loss:.3e}, params {worst_par:.3e} (largest over the "
                 "compared steps)")
    lines.append(f"band: loss {band_loss:.3e}, params {band_par:.3e} (from {source}); margin "
                 f"{MARGIN:g}x")
    for t in common:
        if t not in env:
            continue
        lim_loss, lim_par = (MARGIN * x for x in env[t])
        loss, par = dev[t]
        if loss > lim_loss or (not math.isnan(par) and par > lim_par):
            what = (f"loss deviation {loss:.3e}" if loss > lim_loss else
                    f"parameter distance {par:.3e}")
            limit = lim_loss if loss > lim_loss else lim_par
            return Verdict(False, lines, f"step {t}: {what} is outside the band ({limit:.3e} = "
                                         f"{MARGIN:g} x the regrouping deviation up to it)")
    return Verdict(True, lines)


def run_cli(argv: list[str]) -> int:
    ap = UsageParser(prog="recover verify", description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the run directory to check")
    ap.add_argument("ref", type=Path, help="a failure-free run of the same config (REF)")
    ap.add_argument("--band", type=Path, default=None,
                    help="a failure-free run of the same config with another replica count "
                         "(default: REF/band.json, from recover train --reference)")
    args = ap.parse_args(argv)
    try:
        v = verify(args.run, args.ref, args.band)
    except RecoverError as e:
        return usage_line("recover verify", e)
    for line in v.lines:
        print(line)
    if v.ok:
        print("verdict: pass")
        return ExitCode.OK
    print("verdict: fail", flush=True)
    print(f"recover verify: {v.failure}", file=sys.stderr, flush=True)  # the one line
    return ExitCode.ERROR
