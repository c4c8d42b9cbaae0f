"""The CLI explains itself: defaults and choices in `--help`, the `--fault` grammar from the
parser's own tables, `--config FILE` (TOML or an earlier run's config.json) under the flags,
`--version`. In-process: no run is started here (tests/test_train.py runs one from a config)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from recover import __version__
from recover.app import faults
from recover.app.cli import build_parser, config_from_args, main
from recover.app.config import PRESETS, RunConfig, preset
from recover.app.configfile import RUN_OWN
from recover.control.coordconfig import CoordinatorConfig
from recover.errors import UsageParser

pytestmark = pytest.mark.timeout(60)


def _help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
          argv: list[str]) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def _flag_line(text: str, flag: str) -> str:
    """A flag's entry in the help, on one line (a long flag has its help on the next line)."""
    entry = re.search(rf"^  {re.escape(flag)} .*?(?=^  \S|^$)", text, re.M | re.S)
    assert entry, flag
    return " ".join(entry.group().split())


def test_train_help_shows_defaults_and_choices(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    text = _help(capsys, monkeypatch, ["train", "--help"])
    assert "--dtype {fp32,bf16,fp16}" in text and "--dtype DTYPE" not in text
    assert "--layout {plain,hsdp,tp,pp,'tp,pp'}" in text
    assert "--preset {" + ",".join(PRESETS) + "}" in text
    # A preset decides the default: each preset's value, read from PRESETS.
    steps = ", ".join(f"{n}: {p['run']['steps']}" for n, p in PRESETS.items())
    assert _flag_line(text, "--steps").endswith(f"(default: from --preset ({steps}))")
    # No preset sets it: the field's own default.
    assert _flag_line(text, "--stale-s").endswith(f"(default: {RunConfig().ft.stale_s})")
    assert _flag_line(text, "--policy").endswith("(default: recover)")
    assert "(default" not in _flag_line(text, "--resume")  # a switch
    assert "--config FILE" in text


def _value(m: re.Match[str]) -> str:
    """A value that every kind accepts for the grammar's placeholder letter."""
    return "=" + {"R": "0", "S": "1", "X": "2", "F": "3"}[m.group(1)]


def test_fault_grammar_in_help_is_the_parsers(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    text = _help(capsys, monkeypatch, ["train", "--help"])
    epilog = text[text.index("--fault SPEC (repeatable)"):]
    for kind, what in faults.KIND_HELP.items():
        spec = re.search(rf"^  {kind}:(\S+)\n\s+{re.escape(what)}$", epilog, re.M)
        assert spec, kind
        keys = re.findall(r"(\w+)=", spec.group(1))
        assert set(keys) == faults.ALLOWED[kind], kind
        # Only the required keys: a spec the grammar shows parses.
        required = re.sub(r"\[[^]]*\]", "", spec.group(1))
        example = f"{kind}:" + re.sub(r"=([A-Z])", _value, required)
        assert faults.parse_fault(example).kind == kind
    for phase, what in faults.PHASE_HELP.items():
        assert re.search(rf"^  {phase}\s+{re.escape(what)}$", epilog, re.M), phase
    for example in faults.EXAMPLES:
        assert f"--fault {example}" in epilog
        faults.parse_fault(example)


def test_every_command_shows_defaults(capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert _flag_line(_help(capsys, monkeypatch, ["sample", "--help"]),
                      "--device").endswith("(default: cpu)")
    assert "--device {cpu,cuda}" in _help(capsys, monkeypatch, ["sample", "--help"])
    prepare = _help(capsys, monkeypatch, ["prepare", "--help"])
    assert _flag_line(prepare, "--text-field").endswith("(default: text)")
    ap = UsageParser(prog="recover coordinator")
    CoordinatorConfig.add_arguments(ap)
    coord = ap.format_help()
    assert f"(default: {CoordinatorConfig(replicas=1).stale_s})" in coord
    assert f"(default: {CoordinatorConfig(replicas=1).host})" in coord


def test_version(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert _help(capsys, monkeypatch, ["--version"]).strip() == f"recover {__version__}"
    assert __version__ != "0+unknown"


def _cfg(*argv: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_toml_config_under_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[run]\npreset = "small"\nsteps = 7\nout = "%s"\n[optim]\nlr = 0.002\n'
                    '[ft]\nfaults = ["kill:replica=1,step=3"]\n' % (tmp_path / "o"))
    cfg = _cfg("--config", str(path), "--lr", "0.001")
    small = preset("small")
    assert (cfg.run.steps, cfg.optim.lr, cfg.ft.faults) == (7, 0.001, ["kill:replica=1,step=3"])
    assert cfg.model == small.model and cfg.data.microbatches == small.data.microbatches
    assert cfg.run.out == str(tmp_path / "o")  # a TOML file is the user's: every key counts


def test_run_config_json_leaves_that_runs_own_fields(tmp_path: Path) -> None:
    earlier = preset("debug").replace(
        run={"out": str(tmp_path / "earlier"), "resume": True, "stop_at": 20, "steps": 30},
        ft={"faults": ["kill:replica=1,step=25"]}, optim={"lr": 0.001}, layout={"replicas": 2})
    path = tmp_path / "config.json"
    path.write_text(earlier.to_json())
    cfg = _cfg("--config", str(path), "--steps", "5")
    for sec, keys in RUN_OWN.items():
        for key in keys:
            if key != "out":
                assert getattr(getattr(cfg, sec), key) == getattr(getattr(RunConfig(), sec), key)
    assert cfg.run.out.startswith("runs/debug-")
    assert cfg.replace(run={"steps": 30, "out": earlier.run.out, "resume": True, "stop_at": 20},
                       ft={"faults": earlier.ft.faults}) == earlier


@pytest.mark.parametrize("text, needle", [
    ("[optim]\nlrr = 1\n", "unknown config field(s): optim.lrr"),
    ('[optim]\nlr = "fast"\n', "optim.lr must be a number (got 'fast')"),
    ('[compute]\ndtype = "fp8"\n', "unknown compute.dtype 'fp8'"),
    ("[optimizer]\nlr = 1\n", "unknown section 'optimizer'"),
    ("[optim\n", "is not valid TOML"),
])
def test_bad_config_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                     text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert err.startswith(f"recover train: error: --config {path}")
    assert not (tmp_path / "o").exists()


def test_config_json_with_a_bad_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = json.loads(preset("debug").to_json())
    d["data"]["microbatchez"] = 8
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert main(["train", "--config", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown config field(s): data.microbatchez" in err
