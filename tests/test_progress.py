"""What `recover train` shows and where it writes metrics, in-process (train/progress.py,
train/writers.py): piped lines whole and timestamped, the terminal's progress bar, TensorBoard's
hparams, a missing package as one line and exit 2. The real runs' views are checked on the
kill-and-rejoin run of tests/faults/test_crashes.py."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from harness import viewers
from recover.app.cli import main
from recover.app.config import preset
from recover.app.train.progress import ProgressView
from recover.app.train.writers import TensorBoardWriter, Writers, check, tensorboard_dir
from recover.errors import ConfigError

STEPS = 12
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d "


def record(step: int, **extra: object) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "lr": 3e-3, "tokens_per_s": 12345.6,
            "live_replicas": 4, "generation": 0, "recovered": [], "recovery_s": 0.0,
            "attempts": 1, "time_s": 1.0 + step, **extra}


def show(console: Console, log_every: int) -> None:
    view = ProgressView(console, 0, STEPS, log_every=log_every)
    for s in range(STEPS):
        fault = s == 6
        rec = record(s, recovered=[48, 49] if fault else [], recovery_s=0.05 if fault else 0.0,
                     attempts=2 if fault else 1, live_replicas=3 if fault else 4)
        view.step(rec, ["replica 2 left the job: connection closed"] if fault else [])
    view.close()


def test_piped_lines_are_whole_and_timestamped() -> None:
    out = io.StringIO()
    show(Console(file=out, width=40, force_terminal=False), log_every=5)
    lines = out.getvalue().splitlines()
    assert all(re.match(STAMP, x) for x in lines), lines  # none wrapped at 40 columns
    steps = [int(m.group(1)) for x in lines if (m := re.match(STAMP + r"step +(\d+)/", x))]
    assert steps == [0, 5, 6, 10, 11], lines  # every 5th, the fault's, the last
    fault = next(x for x in lines if " step     6/" in x)
    assert "recovered 2 microbatch(es)" in fault and re.search(r"eta \d:\d\d:\d\d$", fault)
    assert any(x.endswith("recover: step 6: replica 2 left the job: connection closed")
               for x in lines), lines
    assert "\x1b[" not in out.getvalue()  # no terminal codes in a file


def test_terminal_shows_a_progress_bar_and_a_line_per_fault() -> None:
    out = io.StringIO()
    show(Console(file=out, width=120, force_terminal=True), log_every=1)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert f"{STEPS}/{STEPS}" in text and "loss 3.9000" in text and "eta" in text, text
    assert "recover: step 6: replica 2 left the job" in text
    assert " step     3/" not in text  # no per-step lines under the bar


def test_tensorboard_holds_the_config_as_hparams(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    cfg = preset("debug")
    cfg.run.out = str(tmp_path)
    writers = Writers([TensorBoardWriter(tmp_path / "tb", cfg)])
    writers.write(0, {"loss": 2.5}, {"events/fault": "replica 1 left the job"})
    writers.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    raw = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(raw).session_start_info.hparams
    assert hp["optim.lr"].number_value == cfg.optim.lr and hp["run.seed"].number_value == 1337
    scalars, texts = viewers.tensorboard(tmp_path / "tb")
    assert scalars["loss"] == {0: 2.5} and texts["events/fault"] == {0: "replica 1 left the job"}


def test_a_failing_writer_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    class Broken:  # a backend that fails (a full disk, a lost W&B service)
        closed = False

        def write(self, step: int, scalars: dict, texts: dict) -> None:
            raise OSError("no space left on device")

        def close(self) -> None:
            Broken.closed = True

    cfg = preset("debug")
    cfg.run.out = str(tmp_path)
    writers = Writers([Broken(), TensorBoardWriter(tmp_path / "tb", cfg)])
    for s in range(3):
        writers.write(s, {"loss": float(s)}, {})
    writers.close()
    assert Broken.closed and viewers.tensorboard(tmp_path / "tb")[0]["loss"] == {0: 0, 1: 1, 2: 2}


def test_tensorboard_default_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = preset("debug")
    cfg.run.out = str(tmp_path)
    assert tensorboard_dir(cfg) == tmp_path / "tensorboard"
    cfg.run.tensorboard = "none"
    assert tensorboard_dir(cfg) is None
    cfg.run.tensorboard = "auto"
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    assert tensorboard_dir(cfg) is None
    check(cfg)  # the default without the package: off, no error


@pytest.mark.parametrize(("flag", "package"), [("--tensorboard", "tensorboard"),
                                               ("--wandb", "wandb")])
def test_missing_package_is_one_line_and_exit_2(tmp_path: Path, flag: str, package: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    with pytest.raises(ConfigError, match=f"recover\\[{package}\\]"):
        cfg = preset("debug")
        setattr(cfg.run, flag.lstrip("-"), str(tmp_path / "x"))
        check(cfg)
    rc = main(["train", "--out", str(tmp_path / "run"), flag, str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"pip install 'recover[{package}]'" in err[0], err
    assert not (tmp_path / "run").exists()  # refused before anything of the run was made


def test_a_bad_wandb_project_is_one_line_and_exit_2(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["train", "--out", str(tmp_path / "run"), "--wandb", "team/project"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "Invalid project name" in err[0], err
