"""The config's sub-configs, the `recover train` flags generated from them, and trajectory_key."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from recover.app.cli import build_parser, config_fields, config_from_args
from recover.app.config import LAYOUTS, RunConfig, flag_of, flatten, preset
from recover.errors import ConfigError
from recover.layouts import LAYOUTS as PARALLEL_LAYOUTS

# Today's trajectory: everything a failure-free loss curve depends on, nothing it does not.
TRAJECTORY = {f"model.{f}" for f in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                                     "dropout", "bias", "identity", "hf_config")} | {
    f"optim.{f}" for f in ("lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2",
                           "grad_clip")} | {
    f"data.{f}" for f in ("path", "sampling", "val_fraction", "microbatches", "microbatch_size",
                          "eval_every", "eval_microbatches")} | {
    "run.seed", "run.steps", "ft.policy", "compute.dtype", "compute.reduce_dtype", "compute.exact",
    "compute.bucket_mb"}


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
        assert any(words[0] == flag and " ".join(f.metadata["help"].split()) in " ".join(words)
                   for words in entries), flag
    # Today's flag names, by hand: tests, README and scripts use them.
    for flag in ("--replicas", "--microbatches", "--microbatch-size", "--data", "--layout",
                 "--speed-aware", "--fault", "--resume", "--reference", "--dump-final-params",
                 "--preset", "--out", "--stop-at", "--n-embd", "--vocab-size", "--policy",
                 "--external-workers", "--port"):
        assert flag in help_text


def test_flags_set_nested_fields(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    faults = ["kill:replica=0,step=1", "slow:replica=1,factor=2"]
    cfg = _cfg("--microbatch-size", "4", "--data", str(corpus), "--layout", "hsdp",
               "--shards", "2", "--replicas", "2", "--speed-aware", "--fault", faults[0],
               "--fault", faults[1], "--reference", "--dump-final-params", "--lr", "0.002",
               "--n-layer", "3", "--out", str(tmp_path / "o"), "--stale-s", "3.5")
    assert (cfg.data.microbatch_size, cfg.data.path) == (4, str(corpus))
    assert (cfg.layout.name, cfg.layout.shards, cfg.layout.replicas) == ("hsdp", 2, 2)
    assert cfg.layout.ranks_per_replica() == 2
    assert cfg.ft.speed_aware is True and cfg.ft.faults == faults and cfg.ft.stale_s == 3.5
    assert cfg.run.reference and cfg.run.dump_final and not cfg.run.resume
    assert cfg.optim.lr == 0.002 and cfg.model.n_layer == 3
    assert cfg.run.out == str(tmp_path / "o")
    assert _cfg("--resume", "--steps", "9").run.resume


def test_preset_values_stay_unless_a_flag_is_given() -> None:
    plain = _cfg("--preset", "small")
    assert plain == dataclasses.replace(preset("small"), run=plain.run)
    assert plain.run.out.startswith("runs/small-") and not plain.ft.speed_aware
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

    cfg = _cfg("--stale-s", "3.5", "--min-replicas", "2", "--speed-aware", "--exact",
               "--coordinator-wait-s", "7")
    rc = replica_config(cfg, "h:1", 3, "tok")
    assert (rc.coordinator, rc.replica, rc.token) == ("h:1", 3, "tok")
    for lib, sub in ((FaultTolerance, cfg.ft), (Numerics, cfg.compute)):
        got = rc.ft if lib is FaultTolerance else rc.numerics
        for f in dataclasses.fields(lib):
            assert getattr(got, f.name) == getattr(sub, f.name), f.name
    assert rc.ft.stale_s == 3.5 and rc.ft.min_replicas == 2 and rc.ft.speed_aware
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


def test_every_number_declares_its_bounds() -> None:
    """Each int and float setting (the run config's, the library's FaultTolerance, the
    coordinator's) carries the Bounds its validation checks: a new number cannot skip them."""
    from recover.control.coordconfig import CoordinatorConfig
    from recover.settings import Bounds, FaultTolerance

    hinted = [(cls, f) for cls in (FaultTolerance, CoordinatorConfig)
              for f in dataclasses.fields(cls)]
    cfg = preset("debug")
    hinted += [(type(getattr(cfg, sec.name)), f) for sec in dataclasses.fields(RunConfig)
               for f in dataclasses.fields(getattr(cfg, sec.name))]
    numbers = 0
    for cls, f in hinted:
        typ = typing.get_type_hints(cls)[f.name]
        if typ in (int, float) or set(typing.get_args(typ)) & {int, float}:
            numbers += 1
            assert isinstance(f.metadata.get("bounds"), Bounds), f"{cls.__name__}.{f.name}"
    assert numbers >= 35


def test_bounds_name_the_range() -> None:
    from recover.settings import Bounds

    assert Bounds(1).describe() == ">= 1" and Bounds(0.0, 0.5, True, True).describe() == \
        "in (0, 0.5)"
    b = Bounds(0.0, 10.0, lo_open=True)
    for bad, why in ((0.0, "in (0, 10]"), (float("nan"), "finite"), (float("inf"), "finite"),
                     (11, "in (0, 10]"), ("3", "a number"), (True, "a number")):
        with pytest.raises(ConfigError, match=re.escape(why)):
            b.check("--x", bad, integer=False)
    with pytest.raises(ConfigError, match="an integer"):
        Bounds(0).check("--n", 2.0, integer=True)
    b.check("--x", 10, integer=False)  # an int is a number; the closed end is in


@pytest.mark.parametrize("kwargs, needle", [
    ({"reduce_timeout_s": 0.0}, "reduce_timeout_s must be in (0, 604800]"),
    ({"join_timeout_s": float("nan")}, "join_timeout_s must be a finite number"),
    ({"stale_s": float("inf")}, "stale_s must be a finite number"),
    ({"heartbeat_s": -1.0}, "heartbeat_s must be in (0, "),
    ({"coordinator_wait_s": -1.0}, "coordinator_wait_s must be in [0, "),
    ({"min_replicas": 0}, "min_replicas must be >= 1"),
    ({"stale_s": 0.15}, "stale_s (0.15) must exceed twice heartbeat_s (0.1)"),
    ({"reduce_timeout_s": 1.0}, "reduce_timeout_s (1) must exceed stale_s (2)"),
    ({"speed_aware": "yes"}, "speed_aware must be true or false"),
])
def test_the_library_refuses_bad_fault_tolerance(kwargs: dict, needle: str) -> None:
    """A `Replica` user's FaultTolerance is checked at construction, not at its first wait."""
    from recover.settings import FaultTolerance, Numerics

    with pytest.raises(ConfigError, match=re.escape(needle)):
        FaultTolerance(**kwargs)
    with pytest.raises(ConfigError, match="backend 'mpi'"):
        Numerics(backend="mpi")
    with pytest.raises(ConfigError, match="reduce_dtype 'fp8'"):
        Numerics(reduce_dtype="fp8")
    assert FaultTolerance(stale_s=5.0, reduce_timeout_s=6.0).stale_s == 5.0


def test_the_library_bounds_agree_with_the_engine() -> None:
    """The bounds settings and the coordinator declare are the step engine's own limits."""
    from recover.control.coordconfig import MAX_REPLICAS
    from recover.recovery.step import REDUCE_DTYPES
    from recover.recovery.trailer import MAX_REPLICAS as TRAILER_MAX_REPLICAS
    from recover.settings import REDUCE_DTYPE_NAMES

    assert MAX_REPLICAS == TRAILER_MAX_REPLICAS
    assert set(REDUCE_DTYPE_NAMES) == set(REDUCE_DTYPES)


@pytest.mark.parametrize("kwargs, needle", [
    ({"replicas": 0}, "--replicas must be in [1, 65536] (got 0)"),
    ({"stale_s": 0.0}, "--stale-s must be in (0, "),
    ({"join_timeout_s": float("nan")}, "--join-timeout-s must be a finite number"),
    ({"port": 70000}, "--port must be in [0, 65535]"),
    ({"port": 65535}, "leaves no room"),
    ({"store_shards": 300}, "--store-shards must be in [0, 256]"),
    ({"host": ""}, "--host must not be empty"),
    ({"fingerprint": "a b"}, "holds whitespace"),
])
def test_coordinator_config_refuses_bad_settings(kwargs: dict, needle: str) -> None:
    from recover.control.coordconfig import CoordinatorConfig

    with pytest.raises(ConfigError, match=re.escape(needle)):
        CoordinatorConfig(**{"replicas": 2, **kwargs})


def test_coordinator_files(tmp_path: Path) -> None:
    from recover.control.coordconfig import CoordinatorConfig

    empty = tmp_path / "empty"
    empty.write_text("\n")
    for name, needle in (("/nonexistent/token", "cannot read it"), (str(empty), "is empty"),
                         (str(tmp_path), "cannot read it")):
        with pytest.raises(ConfigError, match=needle):
            CoordinatorConfig(replicas=1, token_file=name).file_token()
    with pytest.raises(ConfigError, match="no such directory"):
        CoordinatorConfig(replicas=1, log_path="/nonexistent/c.jsonl").check_outputs()
    with pytest.raises(ConfigError, match="is a directory"):
        CoordinatorConfig(replicas=1, port_file=str(tmp_path)).check_outputs()
    CoordinatorConfig(replicas=1, log_path=str(tmp_path / "c.jsonl")).check_outputs()


def test_launch_env_strict_names_the_variable() -> None:
    from recover.settings import LaunchEnv, parse_address

    for env, needle in (({"RECOVER_REPLICA": "abc"}, "RECOVER_REPLICA='abc'"),
                        ({"RANK": "-1"}, "RANK='-1'"),
                        ({"RECOVER_REPLICA": "²"}, "RECOVER_REPLICA"),  # a digit int() refuses
                        ({"RECOVER_COORDINATOR": "host:abc"}, "RECOVER_COORDINATOR 'host:abc'"),
                        ({"RECOVER_LOG_LEVEL": "loud"}, "RECOVER_LOG_LEVEL='loud'")):
        lenient = LaunchEnv.from_env(env)  # the default, a coordinator address as given
        assert lenient == LaunchEnv(coordinator=env.get("RECOVER_COORDINATOR"))
        with pytest.raises(ConfigError, match=re.escape(needle)):
            LaunchEnv.from_env(env, strict=True)
    assert LaunchEnv.from_env({"RECOVER_REPLICA": " 3 "}, strict=True).replica == 3
    assert parse_address("[::1]:29600", "x") == ("[::1]", 29600)
    for bad in ("127.0.0.1", "host:abc", ":29600", "h:0", "h:65536", "h:"):
        with pytest.raises(ConfigError, match="is not host:port"):
            parse_address(bad, "--coordinator")


def test_config_json_of_wrong_types_is_one_line(tmp_path: Path) -> None:
    """config.json is read by every worker: a value of the wrong type, or JSON nested past the
    parser's depth, is a ConfigError, never a TypeError or RecursionError."""
    path = tmp_path / "config.json"
    for section, changes, needle in (("data", {"microbatches": "8"}, "--microbatches must be an "
                                      "integer (got '8')"),
                                     ("run", {"steps": True}, "--steps must be an integer"),
                                     ("ft", {"faults": "kill"}, "--fault must be a list"),
                                     ("model", {"bias": 1}, "bias must be true or false"),
                                     ("optim", {"lr": None}, "--lr must be a number")):
        d = json.loads(preset("debug").to_json())
        d[section].update(changes)
        path.write_text(json.dumps(d))
        with pytest.raises(ConfigError, match=re.escape(needle)):
            RunConfig.load(path).validate()
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="not a valid recover config"):
        RunConfig.load(path)
