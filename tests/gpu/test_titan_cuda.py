"""torchtitan's whole `Trainer` under recover on CUDA (skipped without a GPU, as in CI).

The CPU test's job and checks (tests/integrations/test_torchtitan.py), with each replica one rank
on cuda:0 and NCCL inside the replica (NCCL takes one GPU per rank, so one GPU allows one rank
per replica): torchtitan's default attention (Flex) instead of the CPU fallback's SDPA, a SIGKILL
mid-step, the restart and the rejoin, the losses within 1e-5 of the failure-free run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False); CI has none"),
    pytest.mark.timeout(600),
]
pytest.importorskip("torchtitan", exc_type=ImportError)

_spec = importlib.util.spec_from_file_location(
    "titan_cpu_test", Path(__file__).parents[1] / "integrations" / "test_torchtitan.py")
assert _spec is not None and _spec.loader is not None
titan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(titan)


def test_trainer_on_cuda_keeps_the_trajectory(tmp_path: Path, corpus: Path) -> None:
    tok = titan.train_tokenizer(corpus, tmp_path / "tok")
    titan.run_and_check(tmp_path / "run", tok, corpus, ranks=1, device="cuda")
