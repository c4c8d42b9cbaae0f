"""Tests for recover.app.train.optim: schedule shape, weight-decay groups, set_lr."""

from __future__ import annotations

import math

import pytest

from recover.app.config import ModelConfig, OptimConfig, RunConfig, RunSettings
from recover.app.train.model import build_model
from recover.app.train.optim import build_optimizer, lr_at, set_lr


def _cfg(steps: int = 20, **optim: float) -> RunConfig:
    kw = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 4, **optim}
    return RunConfig(optim=OptimConfig(**kw), run=RunSettings(steps=steps))  # type: ignore[arg-type]


def test_warmup_is_linear_from_lr_over_w() -> None:
    cfg = _cfg()
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


def test_cosine_decays_to_min_lr_at_steps() -> None:
    cfg = _cfg()
    lrs = [lr_at(s, cfg) for s in range(4, 25)]
    assert lrs[0] == pytest.approx(cfg.optim.lr)
    assert all(a >= b for a, b in zip(lrs[:-1], lrs[1:], strict=True))  # monotone non-increasing
    mid = 4 + (20 - 4) // 2
    assert lr_at(mid, cfg) == pytest.approx((cfg.optim.lr + cfg.optim.min_lr) / 2)
    assert lr_at(20, cfg) == pytest.approx(cfg.optim.min_lr)
    assert lr_at(100, cfg) == pytest.approx(cfg.optim.min_lr)
    assert lr_at(19, cfg) > cfg.optim.min_lr  # the last trained step is not yet at the floor


def test_no_warmup_and_degenerate_configs() -> None:
    assert lr_at(0, _cfg(warmup_steps=0)) == pytest.approx(1e-3)
    assert lr_at(0, _cfg(min_lr=1e-3)) == pytest.approx(2.5e-4)
    cfg = _cfg(warmup_steps=30)  # warmup longer than the run: still finite and rising
    assert lr_at(19, cfg) == pytest.approx(1e-3 * 20 / 30)
    assert all(math.isfinite(lr_at(s, _cfg(steps=1, warmup_steps=1))) for s in range(3))
    with pytest.raises(ValueError):
        lr_at(-1, cfg)


def test_weight_decay_only_on_matrices_and_set_lr() -> None:
    model = build_model(ModelConfig(block_size=8, n_layer=1, n_head=2, n_embd=16), seed=0)
    cfg = _cfg(weight_decay=0.1, beta1=0.8, beta2=0.9)
    opt = build_optimizer(model, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert decay["betas"] == (0.8, 0.9)
    set_lr(opt, 0.123)
    assert all(g["lr"] == 0.123 for g in opt.param_groups)
