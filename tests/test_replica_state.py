"""`Replica` is `Stateful`: in a loop of your own, a `torch.distributed.checkpoint` save that holds
the replica (beside the model and optimizer) resumes an exact-mode run bitwise.

The workers are this file run as a script (`--worker`): `recover coordinator` and two real
processes, one replica each, a loop on `recover.Replica` as a user writes it (nothing of
`recover.app`). Run A trains STEPS steps and saves at SAVE_AT with `dcp.save`; run B loads that
save and trains the rest: its final parameters are A's, bit for bit. Run C loads the model and
optimizer but not the replica: its exponents start again from the first step's bound, and its
parameters differ (so the replica's entry is what B needed, not an accident of the model).
Run B also needs the plain layout to leave every `.grad` alone until the first step: with views
laid out at construction, `get_state_dict` created no optimizer state for the load to fill, and
B's AdamW started again from nothing (found by this test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

STEPS, SAVE_AT, N = 8, 4, 4


def _worker(argv: list[str]) -> int:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from recover import Replica
    from recover.settings import FaultTolerance, Numerics, ReplicaConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resume", type=Path)
    ap.add_argument("--without-replica", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)  # exact mode's requirement: one intra-op thread
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ReplicaConfig(coordinator=f"127.0.0.1:{a.port}", replica=a.replica,
                           numerics=Numerics(exact=True),
                           ft=FaultTolerance(heartbeat_s=0.1, join_timeout_s=60.0,
                                             reduce_timeout_s=30.0))
    rep = Replica(model, N, optimizer=opt, config=config)
    ckpt = f"replica{a.replica}"
    start = 0
    if a.resume is not None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, **({} if a.without_replica else {"replica": rep})}
        dcp.load(state, checkpoint_id=a.resume / ckpt, no_dist=True)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = SAVE_AT

    def compute(mb_id: int, j: int) -> float:
        g = torch.Generator().manual_seed(mb_id)
        x = torch.randn(4, 8, generator=g)
        x[:, 0] *= 1e-4  # gradients far below the largest: bits a coarser exponent drops
        loss = ((model(x) - torch.randn(4, 1, generator=g)) ** 2).mean()
        (loss / N).backward()
        return loss.item()

    losses = {}
    for step in range(start, STEPS):
        losses[step] = rep.step(step, compute).loss
        opt.step()
        opt.zero_grad()
        if step + 1 == SAVE_AT and a.resume is None:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "replica": rep},
                     checkpoint_id=a.out / ckpt, no_dist=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               a.out / f"final{a.replica}.pt")
    (a.out / f"losses{a.replica}.json").write_text(json.dumps(losses))
    rep.leave()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist: meant
    sys.exit(_worker(sys.argv[2:]))


def _run(out: Path, *flags: str) -> list[dict]:
    """`recover coordinator` and two workers to the end; each replica's final parameters."""
    import torch

    from harness.runs import own_loop

    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    own_loop(out, lambda r: [sys.executable, __file__, "--worker", "--replica", str(r), "--out",
                             str(out), *flags], 2, 120.0, env)
    return [torch.load(out / f"final{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_a_dcp_save_with_the_replica_resumes_exact_mode_bitwise(tmp_path: Path) -> None:
    from harness.runs import bitwise_equal

    whole = _run(tmp_path / "a")
    assert bitwise_equal(whole[0], whole[1])  # one trajectory: every replica holds it
    resumed = _run(tmp_path / "b", "--resume", str(tmp_path / "a"))
    assert all(bitwise_equal(r, w) for r, w in zip(resumed, whole, strict=True))
    without = _run(tmp_path / "c", "--resume", str(tmp_path / "a"), "--without-replica")
    assert not bitwise_equal(without[0], whole[0]), "the replica's exponents made no difference"


def test_the_plain_layout_lays_out_its_views_at_the_first_step_over_one_buffer() -> None:
    """No `.grad` before the first `zero()` (what `get_state_dict` needs to create a never-stepped
    optimizer's state); after a `zero_grad()` that drops them, the views come back over the same
    buffer, not a new one."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from recover.layouts.plain import FlatGrads

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters())
    grads = FlatGrads(model)
    assert all(p.grad is None for p in model.parameters())
    _, osd = get_state_dict(model, opt)
    assert len(osd["state"]) == 4  # every parameter's moments, ready to be loaded into
    buffer = grads.flat.data_ptr()
    for _ in range(2):
        grads.zero()
        model(torch.randn(3, 4)).sum().backward()
        assert grads.flat.data_ptr() == buffer and grads.flat.abs().sum() > 0
        assert all(buffer <= p.grad.data_ptr() < buffer + grads.flat.nbytes
                   for p in model.parameters())
        opt.step()
        opt.zero_grad()  # set_to_none
