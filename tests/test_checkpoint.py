"""Tests for recover.train.checkpoint: exact resume, latest pointer, pruning, and error cases."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from recover.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    RunSettings,
)
from recover.errors import CheckpointError
from recover.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from recover.train.data import microbatch
from recover.train.model import GPT, build_model
from recover.train.optim import build_optimizer, lr_at, set_lr
from recover.workload.ids import id_seed, step_ids

MODEL = ModelConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
CFG = RunConfig(model=MODEL, data=DataConfig(microbatches=3, microbatch_size=4),
                optim=OptimConfig(warmup_steps=2), run=RunSettings(steps=8, seed=5))
TOKENS = (np.arange(4000) * 37 % 256).astype("<u2")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # These tests train a little; with other work on a small CPU box, two intra-op threads per
    # process made them ~15x slower (DESIGN.md section 5 saw the same).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _fresh(seed: int = 0, model_cfg: ModelConfig = MODEL) -> tuple[GPT, torch.optim.AdamW]:
    model = build_model(model_cfg, seed)
    return model, build_optimizer(model, CFG)


def _train(model: GPT, opt: torch.optim.AdamW, start: int, stop: int) -> None:
    """The trainer's step, in miniature: per-id data and dropout seeds, mean over N, clip, AdamW."""
    model.train()
    for step in range(start, stop):
        for i in step_ids(step, CFG.data.microbatches):
            x, y = microbatch(TOKENS, MODEL.block_size, CFG.data.microbatch_size, CFG.run.seed, i)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(id_seed(CFG.run.seed, i, stream=1))
                _, loss = model(x, y)
            (loss / CFG.data.microbatches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CFG.optim.grad_clip)
        set_lr(opt, lr_at(step, CFG))
        opt.step()
        opt.zero_grad(set_to_none=True)


def _assert_same(a: GPT, b: GPT) -> None:
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("stop_at", [0, 3])
def test_resume_continues_bitwise(tmp_path: Path, stop_at: int) -> None:
    ref, ref_opt = _fresh()
    _train(ref, ref_opt, 0, 6)

    model, opt = _fresh()
    _train(model, opt, 0, stop_at)
    path = save_checkpoint(tmp_path, stop_at, model, opt, {"data_pos": stop_at * 3})
    _train(model, opt, stop_at, 6)  # saving must not perturb the run that saved
    _assert_same(ref, model)

    resumed, resumed_opt = _fresh(seed=99)  # different init: everything must come from disk
    meta = load_checkpoint(path, resumed, resumed_opt)
    assert meta["step"] == stop_at and meta["extra"] == {"data_pos": stop_at * 3}
    _train(resumed, resumed_opt, meta["step"], 6)
    _assert_same(ref, resumed)
    for p_ref, p in zip(ref.parameters(), resumed.parameters(), strict=True):
        s_ref, s = ref_opt.state[p_ref], resumed_opt.state[p]
        assert set(s_ref) == set(s) and all(torch.equal(s_ref[k], s[k]) for k in s_ref)
    # Rolling back an optimizer that already has (later) state works the same way.
    load_checkpoint(path, model, opt)
    _train(model, opt, stop_at, 6)
    _assert_same(ref, model)
    assert not dist.is_initialized()  # DCP ran without creating a process group


def test_rng_states_restored(tmp_path: Path) -> None:
    model, opt = _fresh()
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    expected = (torch.rand(3), np.random.rand(3), random.random())
    load_checkpoint(path, model, opt)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1])
    assert expected[2] == got[2]


def test_latest_pointer_and_keep_three(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    model, opt = _fresh()
    (tmp_path / ".tmp_step_00000009_1").mkdir()  # leftover of a crashed save
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, opt, {"s": step})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step_00000003", "step_00000004", "step_00000005"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000005"
    # Re-saving an earlier step (a run resumed from it): it is kept and becomes latest.
    save_checkpoint(tmp_path, 2, model, opt, {})
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_00000002", "step_00000004", "step_00000005"]
    # Re-saving the same step replaces it.
    save_checkpoint(tmp_path, 5, model, opt, {"again": True})
    assert load_checkpoint(tmp_path / "step_00000005", model, opt)["extra"] == {"again": True}
    # A stale pointer falls back to the newest complete directory.
    (tmp_path / "latest").write_text("step_00000099\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000005"


def test_non_json_extra_writes_nothing(tmp_path: Path) -> None:
    model, opt = _fresh()
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, model, opt, {"bad": object()})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def _load_error(path: Path, model_cfg: ModelConfig = MODEL) -> str:
    model, opt = _fresh(model_cfg=model_cfg)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, model, opt)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, opt = _fresh()
    _train(model, opt, 0, 1)
    return save_checkpoint(tmp_path / "ckpt", 1, model, opt, {})


def test_missing_dir_and_meta(saved: Path) -> None:
    assert "not found" in _load_error(saved.parent / "step_00000042")
    (saved / "meta.json").write_text("{truncated")
    assert "unreadable meta.json" in _load_error(saved)
    (saved / "meta.json").unlink()
    assert "meta.json is missing" in _load_error(saved)


def test_corrupt_and_truncated_files(saved: Path) -> None:
    data = saved / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte inside tensor data
    data.write_bytes(bytes(raw))
    assert "corrupt" in _load_error(saved)
    data.write_bytes(bytes(raw[: len(raw) // 2]))
    assert "corrupt" in _load_error(saved)
    (saved / ".metadata").unlink()
    assert "missing" in _load_error(saved)


def test_dcp_failure_from_inside_torch_is_wrapped(saved: Path) -> None:
    # Make the recorded digests agree with a truncated file so the failure surfaces inside DCP
    # (whose CheckpointException is a BaseException, not an Exception).
    data = saved / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    meta = json.loads((saved / "meta.json").read_text())
    meta["files"].pop(data.name)
    (saved / "meta.json").write_text(json.dumps(meta))
    assert "cannot load checkpoint" in _load_error(saved)


def test_shape_and_structure_mismatch(saved: Path) -> None:
    wider = ModelConfig(**{**MODEL.__dict__, "n_embd": 64})
    assert "shape" in _load_error(saved, wider)
    deeper = ModelConfig(**{**MODEL.__dict__, "n_layer": 3})
    assert "different model" in _load_error(saved, deeper)
    shallower = ModelConfig(**{**MODEL.__dict__, "n_layer": 1})
    assert "different model" in _load_error(saved, shallower)


def test_checkpoint_dir_copy_loads(saved: Path, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / saved.name
    shutil.copytree(saved, copy)  # nothing in a checkpoint depends on its absolute location
    model, opt = _fresh(seed=3)
    assert load_checkpoint(copy, model, opt)["step"] == 1
