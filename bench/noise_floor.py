"""The grouping noise floor: how far two failure-free runs drift when only the grouping of the same
microbatches into per-replica sums differs (docs/MEASUREMENTS.md, "Loss tolerances", for any
precision).

One process, no recover protocol: every step computes the N microbatches' gradients one by one
(forward in the given autocast dtype), sums them in groups the way quotas would (2+2+2+2, 3+3+2,
8, 1x8 in reverse), then sums the groups (optionally each group cast to the reduce dtype first,
as a bf16 reduce would), and steps AdamW. Any difference between the groupings' loss curves is
summation-order noise that training amplifies; recover's tolerances are set from it.

    python bench/noise_floor.py [--dtype bf16] [--reduce-dtype bf16] [--steps 40]
    python bench/noise_floor.py --smoke     # 3 steps (CI): the script runs and prints its line

Last line: `noise_floor=<max relative loss difference over steps and groupings>`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from recover.app.config import preset
from recover.app.train.data import load_data, prepare_data
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer, lr_at, set_lr

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GROUPINGS = {"2+2+2+2": [2, 2, 2, 2], "3+3+2": [3, 3, 2], "8": [8], "1x8 reversed": [1] * 8}


def run(groups: list[int], steps: int, dtype: str, reduce_dtype: str, corpus, cfg,
        reverse: bool) -> list[float]:
    from recover.app.train.data import microbatch

    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.run.seed)
    opt = build_optimizer(model, cfg)
    params = [p for p in model.parameters()]
    n = cfg.data.microbatches
    losses = []
    for step in range(steps):
        set_lr(opt, lr_at(step, cfg))
        ids = list(range(step * n, step * n + n))
        order = ids[::-1] if reverse else ids
        group_sums, loss_sum, k = [], 0.0, 0
        for size in groups:
            acc = [torch.zeros_like(p) for p in params]
            for i in order[k:k + size]:
                x, y = microbatch(corpus.train, cfg.model.block_size, cfg.data.microbatch_size,
                                  cfg.run.seed, i)
                for p in params:
                    p.grad = None
                with torch.autocast("cpu", dtype=DT[dtype], enabled=dtype != "fp32"):
                    _, loss = model(x, y)
                (loss / n).backward()
                loss_sum += float(loss.detach())
                for a, p in zip(acc, params, strict=True):
                    a += p.grad
            k += size
            group_sums.append([a.to(DT[reduce_dtype]) for a in acc])
        for j, p in enumerate(params):  # the cross-replica sum, in the reduce dtype
            total = group_sums[0][j].clone()
            for gs in group_sums[1:]:
                total += gs[j]
            p.grad = total.float()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        losses.append(loss_sum / n)
    return losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp32", choices=DT)
    ap.add_argument("--reduce-dtype", default="fp32", choices=DT)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="/tmp/recover-noise-floor")
    ap.add_argument("--smoke", action="store_true", help="3 steps: a few seconds (CI runs it)")
    a = ap.parse_args()
    if a.smoke:
        a.steps = 3
    torch.set_num_threads(1)
    cfg = preset("debug")
    prepare_data(None, Path(a.out), cfg.data.val_fraction,
                 cfg.model.block_size)
    corpus = load_data(Path(a.out))
    t0 = time.time()
    curves = {name: run(g, a.steps, a.dtype, a.reduce_dtype, corpus, cfg, "reversed" in name)
              for name, g in GROUPINGS.items()}
    base = curves["2+2+2+2"]
    worst = 0.0
    for name, c in curves.items():
        rel = max(abs(x - y) / abs(y) for x, y in zip(c, base, strict=True))
        worst = max(worst, rel)
        print(f"{name:>14}: max rel loss diff vs 2+2+2+2 = {rel:.3e}")
    print(f"debug preset, N=8, {a.steps} steps, autocast {a.dtype}, reduce {a.reduce_dtype}, "
          f"{time.time() - t0:.0f}s")
    print(f"noise_floor={worst:.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
