"""A received run directory runs no code (issue 50, item 6).

Invariant checked: a run directory whose checkpoint's DCP metadata (a pickle) carries a payload
(`__reduce__` -> exec, which would create a marker file) and whose manifest is re-signed with the
directory's own `run.token` (so it verifies: that HMAC proves nothing about a received directory)
is refused by `recover sample`, `recover export` (one line, exit 2) and `--resume` (one
`CheckpointError` line, before any process starts); the marker is never created. A non-tensor
entry that would run code when loaded is refused too (`SafeLoadPlanner`, weights_only). An honest
checkpoint still loads through the safe reader, every parameter bitwise.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from recover.app import rundir
from recover.app.cli import main
from recover.app.config import preset
from recover.app.train import foreign
from recover.app.train.checkpoint import files as ckpt_files
from recover.app.train.checkpoint import safe as checkpoint_safe
from recover.app.train.checkpoint.dcp import save_checkpoint
from recover.app.train.optim import build_optimizer
from recover.app.train.prepared import prepare_run
from recover.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)
TOKEN = b"the stranger's own token"


class _Payload:
    """Unpickled by the general unpickler, it creates `marker` (any code would run there)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _run_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory with one checkpoint (step 1), as `recover train` writes it."""
    d, ckpt, _ = _run_dir_and_model(tmp_path)
    return d, ckpt


def _run_dir_and_model(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    d = tmp_path / "received"
    d.mkdir()
    cfg = preset("debug").replace(run={"out": str(d)})
    cfg.model.n_layer, cfg.model.n_embd = 1, 32
    (d / "config.json").write_text(cfg.to_json())
    (d / rundir.RUN_TOKEN).write_bytes(TOKEN + b"\n")
    model = foreign.build_lm(cfg.model, cfg.run.seed)
    opt = build_optimizer(model, cfg)
    extra = {"next_microbatch_id": cfg.data.microbatches, "trajectory": cfg.trajectory_key()}
    ckpt = save_checkpoint(d / "ckpt", 1, model, opt, extra, key=TOKEN)
    return d, ckpt, {k: v.clone() for k, v in model.state_dict().items()}


def _plant(ckpt: Path, marker: Path) -> None:
    """Put the payload inside otherwise genuine DCP metadata and re-sign the manifest with the
    directory's token, as whoever handed the directory over can."""
    md = checkpoint_safe.read_metadata(ckpt)
    md.state_dict_metadata["model.payload"] = _Payload(marker)  # type: ignore[assignment]
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    manifest = ckpt_files.read_manifest(ckpt, TOKEN)
    manifest.pop("files", None)
    (ckpt / "meta.json").unlink()
    ckpt_files.write_manifest(ckpt, manifest, TOKEN)
    ckpt_files.verify(ckpt, TOKEN)  # it verifies: the HMAC is no defence here


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    d, ckpt = _run_dir(tmp_path)
    marker = tmp_path / "code-ran"
    _plant(ckpt, marker)
    return d, marker


def test_the_payload_does_run_when_unpickled(planted: tuple[Path, Path]) -> None:
    """The test's own control: the planted metadata is a working payload."""
    d, marker = planted
    (ckpt,) = (d / "ckpt").glob("step_*")
    pickle.loads((ckpt / ".metadata").read_bytes())
    assert marker.exists()


@pytest.mark.parametrize("command", ["sample", "export"])
def test_sample_and_export_refuse(planted: tuple[Path, Path], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str], command: str) -> None:
    d, marker = planted
    argv = (["sample", "--run", str(d), "--prompt", "a", "--max-new-tokens", "2"]
            if command == "sample" else ["export", "--run", str(d), "--out",
                                         str(tmp_path / "m.safetensors")])
    code, err = _cli(capsys, *argv)
    assert code != 0 and not marker.exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "builtins.exec" in lines[0] and "refused" in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "m.safetensors").exists()


def test_resume_refuses_before_anything_starts(planted: tuple[Path, Path]) -> None:
    d, marker = planted
    cfg = preset("debug").replace(run={"out": str(d), "resume": True})
    cfg.model.n_layer, cfg.model.n_embd = 1, 32
    with pytest.raises(CheckpointError) as e:
        prepare_run(cfg)
    assert "\n" not in str(e.value) and "builtins.exec" in str(e.value)
    assert not marker.exists()


def test_a_non_tensor_entry_that_runs_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    buf = io.BytesIO()
    torch.save({"lr": _Payload(marker)}, buf)
    buf.seek(0)

    class _Item:
        class dest_index:  # noqa: N801 (DCP's ReadItem field)
            fqn = "optim.param_groups.0.lr"

    with pytest.raises(CheckpointError, match="not plain data"):
        checkpoint_safe.SafeLoadPlanner().load_bytes(_Item(), buf)  # type: ignore[arg-type]
    assert not marker.exists()


def test_an_honest_checkpoint_loads_bitwise(tmp_path: Path) -> None:
    from recover.app.train.checkpoint.restore import load_run

    d, _, saved = _run_dir_and_model(tmp_path)
    got = load_run(d).model.state_dict()
    assert sorted(got) == sorted(saved)
    assert all(torch.equal(got[k], v) for k, v in saved.items())
