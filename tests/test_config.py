"""The config's sub-configs, the `recover train` flags generated from them, and trajectory_key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from recover.app.cli import build_parser, config_fields, config_from_args
from recover.app.config import LAYOUTS, RunConfig, flag_of, flatten, preset
from recover.errors import ConfigError
from recover.parallel import LAYOUTS as PARALLEL_LAYOUTS

# Today's trajectory: everything a failure-free loss curve depends on, nothing it does not.
TRAJECTORY = {f"model.{f}" for f in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                                     "dropout", "bias")} | {
    f"optim.{f}" for f in ("lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2",
                           "grad_clip")} | {
    f"data.{f}" for f in ("path", "val_fraction", "microbatches", "microbatch_size",
                          "eval_every", "eval_microbatches")} | {
    "run.seed", "run.steps", "ft.policy", "compute.dtype", "compute.reduce_dtype", "compute.exact"}


def _cfg(*argv: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_flagged_field_is_in_help(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: one line per flag, help included
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    help_text = capsys.readouterr().out
    entries: list[list[str]] = []  # one per option: its line, and its help's own line if long
    for ln in help_text.splitlines():
        if ln.startswith("  --"):
            entries.append(ln.split())
        elif ln.startswith("      ") and entries:
            entries[-1] += ln.split()
    fields = config_fields()
    assert len(fields) >= 40  # every field but model.bias
    for _, f, _ in fields:
        flag = flag_of(f)
        assert any(words[0] == flag and " ".join(words).endswith(f.metadata["help"])
                   for words in entries), flag
    # Today's flag names, by hand: tests, README and scripts use them.
    for flag in ("--replicas", "--microbatches", "--microbatch-size", "--data", "--layout",
                 "--no-speed-aware", "--fault", "--resume", "--reference", "--dump-final-params",
                 "--preset", "--out", "--stop-at", "--n-embd", "--vocab-size", "--policy",
                 "--external-workers", "--port"):
        assert flag in help_text


def test_flags_set_nested_fields(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    cfg = _cfg("--microbatch-size", "4", "--data", str(corpus), "--layout", "hsdp",
               "--shards", "2", "--replicas", "2", "--no-speed-aware", "--fault", "a",
               "--fault", "b", "--reference", "--dump-final-params", "--lr", "0.002",
               "--n-layer", "3", "--out", str(tmp_path / "o"), "--stale-s", "3.5")
    assert (cfg.data.microbatch_size, cfg.data.path) == (4, str(corpus))
    assert (cfg.layout.name, cfg.layout.shards, cfg.layout.replicas) == ("hsdp", 2, 2)
    assert cfg.layout.ranks_per_replica() == 2
    assert cfg.ft.speed_aware is False and cfg.ft.faults == ["a", "b"] and cfg.ft.stale_s == 3.5
    assert cfg.run.reference and cfg.run.dump_final and not cfg.run.resume
    assert cfg.optim.lr == 0.002 and cfg.model.n_layer == 3
    assert cfg.run.out == str(tmp_path / "o")
    assert _cfg("--resume", "--steps", "9").run.resume


def test_preset_values_stay_unless_a_flag_is_given() -> None:
    plain = _cfg("--preset", "small")
    assert plain == dataclasses.replace(preset("small"), run=plain.run)
    assert plain.run.out.startswith("runs/small-") and plain.ft.speed_aware
    assert _cfg("--preset", "small", "--microbatches", "4").data.microbatches == 4


def test_trajectory_key_is_the_marked_fields() -> None:
    cfg = preset("debug")
    assert set(flatten(cfg.trajectory_key())) == TRAJECTORY
    changed = cfg.replace(layout={"replicas": 2, "name": "hsdp"}, ft={"faults": ["x"]},
                          run={"out": "elsewhere", "resume": True, "stop_at": 3})
    assert changed.trajectory_key() == cfg.trajectory_key()
    assert cfg.replace(optim={"lr": 1e-4}).trajectory_key() != cfg.trajectory_key()
    assert cfg.replace(ft={"policy": "shrink-batch"}).trajectory_key() != cfg.trajectory_key()


def test_json_round_trip_and_old_flat_config(tmp_path: Path) -> None:
    cfg = preset("debug").replace(ft={"faults": ["kill:replica=1,step=2"]})
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    assert RunConfig.load(path) == cfg
    assert json.loads(path.read_text())["data"]["microbatches"] == 8  # nested by sub-config
    path.write_text(json.dumps({"preset": "debug", "replicas": 4, "lr": 3e-3, "model": {}}))
    with pytest.raises(ConfigError, match="flat"):
        RunConfig.load(path)
    with pytest.raises(ConfigError, match="unknown config field.*optim.momentum"):
        RunConfig.from_dict({"optim": {"momentum": 0.9}})


def test_replace_copies_deeply() -> None:
    cfg = preset("debug")
    other = cfg.replace(run={"out": "x"})
    other.ft.faults.append("y")
    other.model.n_layer = 7
    assert cfg.ft.faults == [] and cfg.model.n_layer == 2


def test_one_definition_of_layouts() -> None:
    assert PARALLEL_LAYOUTS is LAYOUTS
    with pytest.raises(ConfigError, match="unknown --layout 'ring'; choose from plain"):
        preset("debug").replace(layout={"name": "ring"}).validate()


def test_the_library_settings_come_from_the_run_config() -> None:
    """One translation (`replica_config`): every FaultTolerance and Numerics field is the run
    config's field of the same name, so a setting added to both cannot be left behind."""
    from recover.app.config import replica_config
    from recover.settings import FaultTolerance, Numerics

    cfg = _cfg("--stale-s", "3.5", "--min-replicas", "2", "--no-speed-aware", "--exact",
               "--coordinator-wait-s", "7")
    rc = replica_config(cfg, "h:1", 3, "tok")
    assert (rc.coordinator, rc.replica, rc.token) == ("h:1", 3, "tok")
    for lib, sub in ((FaultTolerance, cfg.ft), (Numerics, cfg.compute)):
        got = rc.ft if lib is FaultTolerance else rc.numerics
        for f in dataclasses.fields(lib):
            assert getattr(got, f.name) == getattr(sub, f.name), f.name
    assert rc.ft.stale_s == 3.5 and rc.ft.min_replicas == 2 and not rc.ft.speed_aware
    assert rc.numerics.exact and rc.ft.coordinator_wait_s == 7


def test_launch_env_is_read_in_one_place() -> None:
    from recover.settings import LaunchEnv, ReplicaConfig

    env = LaunchEnv.from_env({"RECOVER_COORDINATOR": "h:5", "RECOVER_REPLICA": "2", "RANK": "1",
                              "RECOVER_RUN_TOKEN": " s3cret\n", "RECOVER_JOIN_AT": "9",
                              "TORCHELASTIC_RESTART_COUNT": "4", "RECOVER_LOG_LEVEL": "DEBUG"})
    assert env == LaunchEnv("h:5", 2, 1, "s3cret", 9, "4", "debug")
    assert LaunchEnv.from_env({"RECOVER_REPLICA": "x", "RECOVER_LOG_LEVEL": "loud"}) == LaunchEnv()
    resolved = ReplicaConfig(launch=env).resolved()
    assert (resolved.coordinator, resolved.replica, resolved.token) == ("h:5", 2, "s3cret")
    assert resolved.host_port() == ("h", 5)
    assert ReplicaConfig(replica=0, launch=env).resolved().replica == 0  # explicit wins
    with pytest.raises(ValueError, match="RECOVER_COORDINATOR"):
        ReplicaConfig(launch=LaunchEnv()).resolved()
