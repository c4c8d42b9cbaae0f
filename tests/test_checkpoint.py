"""Tests for recover.app.train.checkpoint.dcp: exact resume, safe publishing, authentication,
errors."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness.runs import (
    LAYOUT_ARGS,
    LAYOUT_FLAGS,
    LAYOUT_STEPS,
    Run,
    max_rel,
    recover_train,
)
from recover.app import rundir
from recover.app.cli import main
from recover.app.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    RunSettings,
    preset,
)
from recover.app.runtoken import run_token
from recover.app.train.checkpoint import files as ckpt_files
from recover.app.train.checkpoint.dcp import latest_checkpoint, load_checkpoint, save_checkpoint
from recover.app.train.checkpoint.files import advance_latest, find_latest, write_manifest
from recover.app.train.data import microbatch
from recover.app.train.model import GPT, build_model
from recover.app.train.optim import build_optimizer, lr_at, set_lr
from recover.errors import CheckpointError, ConfigError, ExitCode
from recover.workload.ids import id_seed, step_ids

MODEL = ModelConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
CFG = RunConfig(model=MODEL, data=DataConfig(microbatches=3, microbatch_size=4),
                optim=OptimConfig(warmup_steps=2), run=RunSettings(steps=8, seed=5))
TOKENS = (np.arange(4000) * 37 % 256).astype("<u2")
KEY = b"this run's token"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # These tests train a little; with other work on a small CPU box, two intra-op threads per
    # process made them ~15x slower (docs/MEASUREMENTS.md, "Threads and start-up", saw the same).
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
    path = save_checkpoint(tmp_path, stop_at, model, opt, {"data_pos": stop_at * 3}, key=KEY)
    _train(model, opt, stop_at, 6)  # saving must not perturb the run that saved
    _assert_same(ref, model)

    resumed, resumed_opt = _fresh(seed=99)  # different init: everything must come from disk
    meta = load_checkpoint(path, resumed, resumed_opt, key=KEY)
    assert meta["step"] == stop_at and meta["extra"] == {"data_pos": stop_at * 3}
    _train(resumed, resumed_opt, meta["step"], 6)
    _assert_same(ref, resumed)
    for p_ref, p in zip(ref.parameters(), resumed.parameters(), strict=True):
        s_ref, s = ref_opt.state[p_ref], resumed_opt.state[p]
        assert set(s_ref) == set(s) and all(torch.equal(s_ref[k], s[k]) for k in s_ref)
    # Rolling back an optimizer that already has (later) state works the same way.
    load_checkpoint(path, model, opt, key=KEY)
    _train(model, opt, stop_at, 6)
    _assert_same(ref, model)
    assert not dist.is_initialized()  # DCP ran without creating a process group


def test_rng_states_restored(tmp_path: Path) -> None:
    model, opt = _fresh()
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    path = save_checkpoint(tmp_path, 1, model, opt, {}, key=KEY)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    load_checkpoint(path, model, opt, key=KEY)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1])
    assert expected[2] == got[2]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait(timeout=60)
    return proc.pid  # reaped: no process has this PID now (reuse within the test is negligible)


def test_latest_pointer_and_keep_three(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path, KEY) is None
    model, opt = _fresh()
    host = socket.gethostname()
    (tmp_path / f".tmp_step_00000009_{host}_{_dead_pid()}").mkdir()  # a crashed save's leftover
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, opt, {"s": step}, key=KEY)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != ".latest.lock")
    assert names == ["latest", "step_00000003", "step_00000004", "step_00000005"]
    assert latest_checkpoint(tmp_path, KEY) == tmp_path / "step_00000005"
    # Re-saving an earlier step (a run resumed from it): it is kept, `latest` stays put.
    save_checkpoint(tmp_path, 2, model, opt, {}, key=KEY)
    assert (tmp_path / "latest").read_text() == "step_00000005\n"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_00000002", "step_00000004", "step_00000005"]
    # A stale pointer falls back to the newest verified directory.
    (tmp_path / "latest").write_text("step_00000099\n")
    assert latest_checkpoint(tmp_path, KEY) == tmp_path / "step_00000005"


def test_latest_never_moves_back(tmp_path: Path) -> None:
    model, opt = _fresh()
    save_checkpoint(tmp_path, 7, model, opt, {}, key=KEY)
    save_checkpoint(tmp_path, 3, model, opt, {}, key=KEY)  # e.g. a late writer of an older step
    assert (tmp_path / "latest").read_text() == "step_00000007\n"
    assert not advance_latest(tmp_path, "step_00000006")
    assert advance_latest(tmp_path, "step_00000008")  # forward is fine (even before it exists)
    assert (tmp_path / "latest").read_text() == "step_00000008\n"


def test_second_writer_of_a_step_keeps_the_first(tmp_path: Path) -> None:
    model, opt = _fresh()
    first = save_checkpoint(tmp_path, 4, model, opt, {"who": "first"}, key=KEY)
    _train(model, opt, 0, 1)
    save_checkpoint(tmp_path, 4, model, opt, {"who": "second"}, key=KEY)
    assert load_checkpoint(first, *_fresh(), key=KEY)["extra"] == {"who": "first"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]
    # ... unless the first one does not verify: then it is replaced.
    _tamper_manifest(first)
    save_checkpoint(tmp_path, 4, model, opt, {"who": "third"}, key=KEY)
    assert load_checkpoint(first, *_fresh(), key=KEY)["extra"] == {"who": "third"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".latest.lock", "latest", first.name]


def test_prune_leaves_a_live_writers_temp_dir(tmp_path: Path) -> None:
    host = socket.gethostname()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / f".tmp_step_00000002_{host}_{sleeper.pid}"  # another writer, mid-save
        remote = tmp_path / f".tmp_step_00000002_not-{host}_{_dead_pid()}"  # its PID means nothing
        dead = tmp_path / f".tmp_step_00000002_{host}_{_dead_pid()}"
        dead_pointer = tmp_path / f".latest.{host}_{_dead_pid()}.tmp"
        for p in (live, remote, dead):
            p.mkdir(parents=True)
            (p / "__0_0.distcp").write_bytes(b"partial")
        dead_pointer.write_text("step_00000002\n")
        model, opt = _fresh()
        save_checkpoint(tmp_path, 1, model, opt, {}, key=KEY)
        assert (live / "__0_0.distcp").read_bytes() == b"partial" and remote.is_dir()
        assert not dead.exists() and not dead_pointer.exists()
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)


def _tamper_manifest(path: Path) -> None:
    """Change the label inside an otherwise well-formed meta.json, keeping the old HMAC."""
    outer = json.loads((path / "meta.json").read_text())
    inner = json.loads(outer["manifest"])
    inner["extra"] = {"who": "mallory"}
    outer["manifest"] = json.dumps(inner, sort_keys=True)
    (path / "meta.json").write_text(json.dumps(outer))


def test_tampered_or_truncated_checkpoint_falls_back(tmp_path: Path) -> None:
    model, opt = _fresh()
    _train(model, opt, 0, 1)
    good = save_checkpoint(tmp_path, 1, model, opt, {}, key=KEY)
    _train(model, opt, 1, 2)
    newer = save_checkpoint(tmp_path, 2, model, opt, {}, key=KEY)
    _tamper_manifest(newer)
    msg = _load_error(newer)
    assert "fails authentication" in msg and str(newer / "meta.json") in msg
    path, skipped = find_latest(tmp_path, KEY)
    assert path == good and len(skipped) == 1 and "step_00000002" in skipped[0]
    assert load_checkpoint(path, *_fresh(), key=KEY)["step"] == 1
    # Another run's token authenticates nothing here; a truncated data file is named.
    assert "fails authentication" in _load_error(good, key=b"another run")
    data = good / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    msg = _load_error(good)
    assert "__0_0.distcp" in msg and "sha256" in msg
    assert latest_checkpoint(tmp_path, KEY) is None


def test_another_layout_is_refused(tmp_path: Path) -> None:
    model, opt = _fresh()
    hsdp = {"layout": "hsdp", "shards": 2, "tp": 1, "stages": 1}
    path = save_checkpoint(tmp_path, 1, model, opt, {}, key=KEY, layout=hsdp)
    with pytest.raises(CheckpointError, match="--layout hsdp --shards 2; this run is --layout "
                                              "plain: resume with the same layout"):
        load_checkpoint(path, *_fresh(), key=KEY)
    assert load_checkpoint(path, *_fresh(), key=KEY, layout=hsdp)["step"] == 1


def test_run_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECOVER_RUN_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="no run token"):
        run_token(tmp_path)
    token = run_token(tmp_path, create=True)
    assert len(token) == 64 and (tmp_path / rundir.RUN_TOKEN).stat().st_mode & 0o777 == 0o600
    assert run_token(tmp_path, create=True) == token == run_token(tmp_path)  # never rewritten
    monkeypatch.setenv("RECOVER_RUN_TOKEN", "from-the-env")
    assert run_token(tmp_path / "elsewhere") == b"from-the-env"


def test_non_json_extra_writes_nothing(tmp_path: Path) -> None:
    model, opt = _fresh()
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, model, opt, {"bad": object()}, key=KEY)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def _load_error(path: Path, model_cfg: ModelConfig = MODEL, key: bytes = KEY) -> str:
    model, opt = _fresh(model_cfg=model_cfg)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, model, opt, key=key)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, opt = _fresh()
    _train(model, opt, 0, 1)
    return save_checkpoint(tmp_path / "ckpt", 1, model, opt, {}, key=KEY)


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
    manifest = json.loads(json.loads((saved / "meta.json").read_text())["manifest"])
    write_manifest(saved, manifest, KEY)  # re-signed by the key holder: digests now agree
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
    assert load_checkpoint(copy, model, opt, key=KEY)["step"] == 1


# -- multi-rank layouts, real processes ------------------------------------------------------
STEPS, ARGS, LAYOUT = LAYOUT_STEPS, LAYOUT_ARGS, LAYOUT_FLAGS


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["hsdp", "tp", "pp"])
def test_layout_stop_and_resume(single_replica: Run, corpus: Path, tmp_path: Path,
                                layout: str) -> None:
    """2 replicas x 2 ranks: --stop-at, then --resume past a tampered newest checkpoint."""
    out, args = tmp_path / "run", [*ARGS, "--replicas", "2", *LAYOUT[layout]]
    first = recover_train(out, *args, "--stop-at", "3", "--ckpt-every", "2", data=corpus)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = out / rundir.CKPT
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".latest.lock", "latest", "step_00000002", "step_00000003"]  # nothing half-written
    # One copy, by the leader replica's two ranks together (a shard / stage file each).
    assert sorted(p.name for p in (ckpt / "step_00000003").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    _tamper_manifest(ckpt / "step_00000003")
    second = recover_train(out, *args, "--resume", data=corpus)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "skipped step_00000003" in second.stderr and "fails authentication" in second.stderr
    assert "--resume from step_00000002" in second.stderr
    assert [r["step"] for r in second.metrics()] == list(range(STEPS))
    assert max_rel(second.losses(), single_replica.losses()) < 1e-5
    assert (ckpt / "latest").read_text() == f"step_{STEPS:08d}\n"
    other = LAYOUT["tp" if layout == "hsdp" else "hsdp"]
    third = recover_train(out, *args[:-len(other)], *other, "--resume", data=corpus)
    assert third.returncode != 0 and "resume with the same layout" in third.stderr


# -- crafted meta.json: skipped as a tampered checkpoint is, never a crash ---------------------
def _signed(manifest_text: str, key: bytes = KEY) -> str:
    """An outer meta.json around `manifest_text`, with a valid HMAC (as only the key holder can)."""
    return json.dumps({"manifest": manifest_text,
                       "hmac": hmac.new(key, manifest_text.encode(), hashlib.sha256).hexdigest()})


@pytest.mark.parametrize("craft, why", [
    (lambda m: m.write_text("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    (lambda m: m.write_text(_signed("[" * 100_000 + "]" * 100_000)), "not a format-2"),
    (lambda m: m.write_bytes(b" " * (ckpt_files.MAX_META_BYTES + 1)), "oversized meta.json"),
    (lambda m: m.write_bytes(b"\xff\xfe{}"), "unreadable meta.json"),
    (lambda m: (m.unlink(), os.mkfifo(m)), "not a regular file"),
    (lambda m: (m.unlink(), m.mkdir()), "unreadable meta.json"),
], ids=["nested", "nested-but-signed", "oversized", "not-utf8", "fifo", "a-folder"])
def test_crafted_meta_json_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      craft: Any, why: str) -> None:
    # A cap this small keeps the oversized file small (the real manifests here are ~20 KB).
    monkeypatch.setattr(ckpt_files, "MAX_META_BYTES", 1 << 18)
    model, opt = _fresh()
    good = save_checkpoint(tmp_path, 1, model, opt, {}, key=KEY)
    newest = save_checkpoint(tmp_path, 2, model, opt, {}, key=KEY)
    craft(newest / "meta.json")
    path, skipped = find_latest(tmp_path, KEY)
    assert path == good, skipped
    assert len(skipped) == 1 and "step_00000002" in skipped[0] and why in skipped[0], skipped
    assert why in _load_error(newest)


# -- --resume: what it needs is checked before anything is written ------------------------------
def _stopped_run(tmp_path: Path, step: int = 12) -> Path:
    """A run directory as `recover train --steps 20 --stop-at 12` leaves it (a checkpoint at 12),
    with the run's own token."""
    out = tmp_path / "run"
    cfg = preset("debug")
    cfg.run.steps, cfg.run.out = 20, str(out)
    out.mkdir()
    (out / rundir.CONFIG).write_text(cfg.to_json())
    model, opt = _fresh()
    save_checkpoint(out / rundir.CKPT, step, model, opt, {}, key=run_token(out, create=True))
    return out


def _tree(out: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*"))}


def _resume(capsys: pytest.CaptureFixture[str], out: Path, *args: str) -> tuple[int, str]:
    code = main(["train", "--out", str(out), "--steps", "20", "--resume", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return code, err


def test_resume_without_the_token(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECOVER_RUN_TOKEN", raising=False)
    out = _stopped_run(tmp_path)
    (out / rundir.RUN_TOKEN).unlink()  # or: the run was started with RECOVER_RUN_TOKEN, unset now
    before = _tree(out)
    code, err = _resume(capsys, out)
    assert code == ExitCode.USAGE
    assert "no run token" in err and "run.token" in err and "RECOVER_RUN_TOKEN" in err, err
    assert "tamper" not in err
    assert _tree(out) == before  # no new token (it would authenticate nothing), nothing else


@pytest.mark.parametrize("stop_at", [8, 12])
def test_resume_stop_at_behind_the_checkpoint(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path, stop_at: int) -> None:
    out = _stopped_run(tmp_path, step=12)
    before = _tree(out)
    code, err = _resume(capsys, out, "--stop-at", str(stop_at))
    assert code == ExitCode.USAGE
    assert f"--stop-at {stop_at} is not after step 12" in err and "step_00000012" in err, err
    assert _tree(out) == before  # refused before any process started or file was written
