"""Tests of `recover simulate` (recover.app.sim.cli.run_cli): paper scenario, outputs, bad input."""

from __future__ import annotations

import json
import re
import time

import pytest

from harness.sim import calib
from recover.app.sim.cli import run_cli

LAST_LINES = re.compile(
    r"throughput_ratio=(?P<ratio>[0-9.]+|inf|nan)\n"
    r"extra_tokens_pct_at_234_gpu_hours=(?P<extra>-?[0-9.]+|inf|nan)\n$"
)


def test_paper_scenario_prints_last_lines(capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    rc = run_cli(["--scenario", "paper"])
    elapsed = time.monotonic() - t0
    out = capsys.readouterr().out
    assert rc == 0
    assert elapsed < 20.0
    m = LAST_LINES.search(out)
    assert m is not None, out[-500:]
    assert float(m["ratio"]) > 1.0
    assert float(m["extra"]) > 0.0
    head = out[: m.start()]
    for needle in (
        "assumptions:",
        "512 GPUs",
        "8 GPUs per replica",
        "32 scheduled replica losses",
        "restart 300.0 s",
        "checkpoint cost 60.0 s",
        "Young-Daly",
        "recover ",
        "ckpt-restart ",
        "shrink-batch ",
    ):
        assert needle in head, needle


def test_paper_scenario_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--scenario", "paper", "--seeds", "3"]) == 0
    a = capsys.readouterr().out
    assert run_cli(["--scenario", "paper", "--seeds", "3"]) == 0
    assert capsys.readouterr().out == a


def test_outputs_written(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_cli(["--scenario", "paper", "--seeds", "2", "--out", str(tmp_path / "o")])
    assert rc == 0
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert set(doc["policies"]) == {"recover", "ckpt-restart", "shrink-batch"}
    assert (tmp_path / "o" / "tokens_vs_gpu_hours.png").stat().st_size > 1000
    assert run_cli(["--total-steps", "200", "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").exists()
    assert LAST_LINES.search(capsys.readouterr().out)


def test_sensitivity_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--scenario", "paper", "--seeds", "2", "--sensitivity"]) == 0
    out = capsys.readouterr().out
    for knob in ("loss every", "ckpt interval", "restart cost", "Llama 3 rate", "vanishes"):
        assert knob in out, knob
    assert "for throughput_ratio = 2.23" in out
    assert LAST_LINES.search(out)


def test_calibrate_validation_table(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = calib(fault_steps=[12],
                  wall_s={"recover": 14.0, "ckpt-restart": 22.0, "shrink-batch": 13.5})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert run_cli(["--calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "validation" in out and "predicted s" in out
    assert LAST_LINES.search(out)
    assert run_cli(["--calibrate", str(path), "--scenario", "paper", "--seeds", "1"]) == 0
    assert "restart 6.0 s" in capsys.readouterr().out  # the bench's costs carried over


def _bad(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = run_cli(argv)
    cap = capsys.readouterr()
    assert rc == 2, cap.out[-300:]
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1, cap.err
    assert lines[0].startswith("recover simulate: error: ")
    assert "Traceback" not in cap.err
    return lines[0]


def test_bad_inputs_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "trace" in _bad(["--failure-trace", str(tmp_path / "none.csv")], capsys)
    bad = tmp_path / "bench.json"
    bad.write_text("{oops")
    assert "JSON" in _bad(["--calibrate", str(bad)], capsys)
    bad.write_text(json.dumps({"replicas": 4}))
    assert "missing" in _bad(["--calibrate", str(bad)], capsys)
    _bad(["--calibrate", str(tmp_path / "absent.json")], capsys)
    _bad(["--gpus=-8"], capsys)
    _bad(["--restart-cost-s", "-5"], capsys)
    assert "divisible" in _bad(["--gpus", "10", "--gpus-per-replica", "4"], capsys)
    _bad(["--no-such-flag"], capsys)
    _bad(["--scenario", "moon"], capsys)
    _bad(["--gpus", "many"], capsys)
    _bad(["--scenario", "paper", "--lost-gpus", "512"], capsys)
    _bad(["--scenario", "paper", "--lost-gpus", "12"], capsys)  # not whole replicas
    assert "drop --budget-h" in _bad(["--scenario", "paper", "--budget-h", "2"], capsys)
    _bad(["--seeds", "0"], capsys)
    _bad(["--plot", str(tmp_path / "p.unknownformat"), "--total-steps", "10"], capsys)
    trace = tmp_path / "t.csv"
    trace.write_text("1.0,notagpu\n")
    _bad(["--failure-trace", str(trace)], capsys)


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--help"]) == 0
    assert "recover simulate" in capsys.readouterr().out


def test_every_param_has_a_flag() -> None:
    from dataclasses import fields

    from recover.app.sim.flags import FLAGS
    from recover.app.sim.params import SimParams

    assert set(FLAGS) == {f.name for f in fields(SimParams)}


def test_flags_reach_the_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--gpus",
        "64",
        "--gpus-per-replica",
        "4",
        "--microbatches",
        "32",
        "--total-steps",
        "100",
        "--fault-steps",
        "3,50",
        "--ckpt-interval-steps",
        "10",
        "--ckpt-cost-s",
        "7",
        "--restart-cost-s",
        "42",
        "--step-time-by-replicas",
        "15:5.5",
        "--seeds",
        "2",
    ]
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    assert "64 GPUs, 4 GPUs per replica -> 16 replicas" in out
    assert "every 10 steps (given)" in out and "restart 42.0 s" in out
    assert "2 replica kill(s) at steps [3, 50]" in out


def test_paper_figures_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    # The paper scenario's two figures as of the scale scenario's arrival (weak scaling keeps N).
    assert run_cli(["--scenario", "paper"]) == 0
    assert capsys.readouterr().out.endswith(
        "throughput_ratio=2.695\nextra_tokens_pct_at_234_gpu_hours=119.4\n"
    )


def test_scale_scenario_quick(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    argv = ["--scenario", "scale", "--quick", "--out", str(tmp_path / "o")]
    assert run_cli(argv) == 0
    elapsed = time.monotonic() - t0
    out = capsys.readouterr().out
    assert elapsed < 60.0
    m = re.search(r"ettr_recover_at_100k=([0-9.]+)\n$", out)
    assert m is not None, out[-500:]
    assert 0.0 < float(m[1]) <= 1.0
    for needle in ("Llama 3", "419", "FT-HSDP", "2602.00277", "source: ", "interpolated"):
        assert needle in out, needle
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    sizes = doc["sizes"]
    assert [s["gpus"] for s in sizes] == [1024, 8192, 65536, 131072]
    for s in sizes:
        for name, v in s["ettr"].items():
            assert 0.0 < v <= 1.0, (s["gpus"], name, v)
        assert s["params"]["microbatches"] >= s["gpus"] // s["params"]["gpus_per_replica"]
    ck = [s["ettr"]["ckpt-restart"] for s in sizes]
    assert ck == sorted(ck, reverse=True) and ck[0] > ck[-1]
    assert (tmp_path / "o" / "ettr_vs_gpus.png").stat().st_size > 1000


def test_scale_scenario_reads_the_curve_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from recover.app.sim.curve import COLUMNS

    curve = {"source": "measured by a test", "ranks": [4, 128], **{c: [0.0, 0.0] for c in COLUMNS}}
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(curve))
    argv = ["--scenario", "scale", "--sizes", "1024,2048", "--seeds", "1", "--budget-h", "24"]
    assert run_cli([*argv, "--curve", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "source: measured by a test" in out
    assert "the nearest size, 2,048 GPUs" in out
    assert re.search(r"ettr_recover_at_100k=([0-9.]+)\n$", out)
    path.write_text(json.dumps({**curve, "reduce_s": [0.1]}))
    assert "reduce_s" in _bad([*argv, "--curve", str(path)], capsys)
    assert "drop --gpus" in _bad(["--scenario", "scale", "--gpus", "1024"], capsys)
    assert "needs --scenario scale" in _bad(["--quick"], capsys)
    _bad(["--scenario", "scale", "--sizes", "1000"], capsys)  # not whole 128-GPU replicas
    _bad(["--scenario", "scale", "--sensitivity"], capsys)


def test_default_run_at_100k_gpus_keeps_every_replica_busy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_cli(["--gpus", "100000", "--total-steps", "200"]) == 0
    out = capsys.readouterr().out
    replicas = int(re.search(r"-> ([0-9,]+) replicas", out)[1].replace(",", ""))
    n = int(re.search(r"batch: N = ([0-9,]+) microbatches", out)[1].replace(",", ""))
    assert replicas == 12_500 and n >= replicas
    assert LAST_LINES.search(out)
