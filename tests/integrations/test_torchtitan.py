"""torchtitan's Llama debug model as recover replicas (`recover.integrations.torchtitan`), on CPU.

Each replica is one `torchrun` of two ranks running torchtitan's model, `parallelize_fn` (FSDP2
over the two), AdamW and LR scheduler; the replicas meet at a `recover coordinator`. A replica's
rank is SIGKILLed mid-step, torchrun restarts the replica and it rejoins with a live transfer:
the survivor's losses match a failure-free run's, every step had N microbatches, and the two
replicas end with bitwise the same parameters. Skipped when torchtitan is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", exc_type=ImportError)
tokenizers = pytest.importorskip("tokenizers")

import torch  # noqa: E402

from recover.testing.runs import max_rel  # noqa: E402

JOB = Path(__file__).with_name("_titan_job.py")
STEPS, N, TOL = 4, 4, 1e-5  # TOL: fp32, the bound on the relative loss difference
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def tokenizer_dir(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer.json trained on the corpus (torchtitan loads the folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]))
    out = tmp_path_factory.mktemp("tok")
    tok.save(str(out / "tokenizer.json"))
    return out


def _wait_file(path: Path, procs: list[subprocess.Popen], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        assert all(p.poll() is None for p in procs), "the coordinator exited early"
        time.sleep(0.1)
    raise AssertionError(f"no {path} within {timeout_s} s")


def run(out: Path, replicas: int, kill: str, tok: Path, text: Path) -> list[int]:
    """A coordinator and one 2-rank torchrun per replica (at most one restart); exit codes."""
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    exe = Path(sys.executable).parent
    coord = subprocess.Popen(
        [str(exe / "recover"), "coordinator", "--replicas", str(replicas), "--port", "0",
         "--port-file", str(out / "port"), "--exit-when-done", "--host", "127.0.0.1"],
        env=env, stdout=open(out / "coord.log", "w"), stderr=subprocess.STDOUT)
    procs = [coord]
    try:
        port = _wait_file(out / "port", procs, 60)
        for r in range(replicas):
            procs.append(subprocess.Popen(
                [str(exe / "torchrun"), "--standalone", "--nproc-per-node", "2",
                 "--max-restarts", "1", str(JOB), str(out), str(tok), str(text), str(STEPS),
                 str(N), kill],
                env={**env, "RECOVER_COORDINATOR": f"127.0.0.1:{port}",
                     "RECOVER_REPLICA": str(r)},
                stdout=open(out / f"replica{r}.log", "w"), stderr=subprocess.STDOUT))
        return [p.wait(timeout=TIMEOUT_S) for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_kill_and_restart_keeps_the_trajectory(tmp_path: Path, tokenizer_dir: Path,
                                               corpus: Path) -> None:
    ref_codes = run(tmp_path / "ref", 1, "-", tokenizer_dir, corpus)
    codes = run(tmp_path / "kill", 2, "1:2:1", tokenizer_dir, corpus)
    log = (tmp_path / "kill" / "replica1.log").read_text()
    assert ref_codes == [0] and codes == [0, 0], log[-3000:]
    ref = json.loads((tmp_path / "ref" / "replica0.json").read_text())["steps"]
    got = [json.loads((tmp_path / "kill" / f"replica{r}.json").read_text()) for r in (0, 1)]
    survivor = got[0]["steps"]
    assert sorted(survivor) == sorted(ref) == [str(s) for s in range(STEPS)]
    assert all(row[1] == N for row in survivor.values())  # every step: N microbatches
    assert max_rel([survivor[s][0] for s in sorted(ref)], [ref[s][0] for s in sorted(ref)]) <= TOL
    # the restarted replica rejoined mid-run (a live transfer), not from step 0
    assert 0 < got[1]["start"] < STEPS
    assert any(row[2] == [0] for row in survivor.values())  # a step ran without replica 1
    a, b = (torch.load(tmp_path / "kill" / f"params{r}.pt") for r in (0, 1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
