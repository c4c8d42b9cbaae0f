"""Any model through `recover train` (`--model hf:PATH`, `--model module:function`), and what a
trained run gives back (`recover sample`, `recover export`).

Two real runs, each with a replica SIGKILLed mid-backward and its failure-free reference
(`--reference`): a tiny Llama from `transformers` in the hsdp layout (2 replicas x 2 shard ranks)
and a test module's own model in the plain layout; both follow their references within 1e-5 at
every step. From the same runs: `recover sample` prints text, and `recover export` writes files
that `transformers`' `from_pretrained` / plain `safetensors` load, bitwise equal to the
checkpoint's parameters (the final parameters every replica dumped: the last checkpoint's).
Everything else is in-process: bad input is one line and exit 2, model identity is in the
fingerprint, a model is a pure function of (config, seed) that leaves the global RNG alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from harness.runs import LAYOUT_ARGS, LAYOUT_FLAGS, LAYOUT_STEPS, Run, recover_train
from recover.app import rundir
from recover.app.cli import main
from recover.app.config import RunConfig, fingerprint
from recover.app.prepare import run_cli
from recover.app.train import foreign

# The `hf` extra (transformers, safetensors); the README's test command installs every extra.
transformers = pytest.importorskip("transformers")
AutoModelForCausalLM, LlamaConfig = transformers.AutoModelForCausalLM, transformers.LlamaConfig
pytestmark = pytest.mark.timeout(300)
MODELS = Path(__file__).parent / "_foreign_models.py"
N = 8
FAULT = ["--fault", "kill:replica=1,step=3,phase=backward"]


def tiny_llama(folder: Path, **changes: int) -> Path:
    """A Llama config.json small enough to train in seconds (vocabulary: bytes)."""
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaConfig(**{**shape, **changes}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def shards(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus as `recover prepare --bytes` token shards (what the models train on here)."""
    out = tmp_path_factory.mktemp("prepared") / "shards"
    assert run_cli([str(corpus), "--bytes", "--out", str(out)]) == 0
    return out


def train_with_reference(out: Path, data: Path, *args: str) -> Run:
    """A 2-replica run on `data` that loses replica 1 at step 3, and its failure-free
    reference."""
    run = recover_train(out, *LAYOUT_ARGS, "--replicas", "2", *FAULT, "--reference", *args,
                        data=data)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = run.metrics()
    assert [r["step"] for r in recs] == list(range(LAYOUT_STEPS))
    assert all(r["microbatches"] == N for r in recs)
    assert recs[2]["live_replicas"] == 2 and recs[-1]["live_replicas"] == 1
    diff = re.search(r"max_rel_loss_diff=(\S+)", run.stdout)
    assert diff is not None, run.stdout
    assert float(diff.group(1)) <= 1e-5
    return run


@pytest.fixture(scope="module")
def hf_run(llama: Path, shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train_with_reference(tmp_path_factory.mktemp("hf") / "run", shards,
                                *LAYOUT_FLAGS["hsdp"], "--model", f"hf:{llama}")


@pytest.fixture(scope="module")
def module_run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return train_with_reference(tmp_path_factory.mktemp("module") / "run", shards,
                                "--model", f"{MODELS}:tiny_lm")


@pytest.mark.parametrize("kind, layout", [("hf", "plain"), ("module", "hsdp")])
def test_the_other_layout_follows_its_reference(kind: str, layout: str, llama: Path,
                                                shards: Path, tmp_path: Path) -> None:
    """The fixtures above run hf in hsdp and module in plain; here the other two pairs."""
    model = f"hf:{llama}" if kind == "hf" else f"{MODELS}:tiny_lm"
    train_with_reference(tmp_path / "run", shards, *LAYOUT_FLAGS.get(layout, ()),
                         "--model", model)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def shards_joined(run: Run, replica: int) -> dict[str, torch.Tensor]:
    """A hsdp replica's final parameters, its 2 shard ranks' row blocks put back together."""
    parts = [torch.load(run.out / rundir.FINAL / f"replica{replica}.rank{k}.pt", weights_only=True)
             for k in range(2)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# -- the runs ------------------------------------------------------------------------------------
def test_hf_model_hsdp_sample_export(hf_run: Run, llama: Path, capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    cfg = json.loads((hf_run.out / rundir.CONFIG).read_text())["model"]
    assert cfg["hf_config"] == json.loads((llama / "config.json").read_text())
    assert cfg["identity"] == "hf:" + foreign.config_digest(cfg["hf_config"])

    code, text, err = cli(capsys, "sample", "--run", str(hf_run.out), "--prompt", "The ",
                          "--max-new-tokens", "24", "--seed", "5")
    assert code == 0, err
    assert text.startswith("The ") and len(text) > len("The \n"), text
    assert "step_00000006" in err
    assert cli(capsys, "sample", "--run", str(hf_run.out), "--prompt", "The ",
               "--max-new-tokens", "24", "--seed", "5")[1] == text  # the seed fixes the draws

    code, out, err = cli(capsys, "export", "--run", str(hf_run.out), "--out", str(tmp_path / "m"))
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    got, want = model.state_dict(), shards_joined(hf_run, 0)
    assert got.keys() == want.keys()
    for k, t in got.items():  # FSDP2 pads no shard here: every dim 0 is even
        assert t.dtype == torch.float32 and torch.equal(t, want[k][:t.size(0)]), k
    code, _, err = cli(capsys, "export", "--run", str(hf_run.out), "--out", str(tmp_path / "m"))
    assert code == 2 and "exists" in err and len(err.strip().splitlines()) == 1


def test_module_model_plain_sample_export(module_run: Run, capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from _foreign_models import TinyLM

    code, text, err = cli(capsys, "sample", "--run", str(module_run.out), "--prompt", "It was",
                          "--temperature", "0", "--max-new-tokens", "12")
    assert code == 0, err
    assert text.startswith("It was") and len(text) > len("It was\n"), text

    out = tmp_path / "tiny.safetensors"
    code, _, err = cli(capsys, "export", "--run", str(module_run.out), "--out", str(out))
    assert code == 0, err
    got, want = load_file(out), module_run.final(0)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    TinyLM(256, 64).load_state_dict(got, strict=True)  # the user's own class takes it as is
    with safe_open(out, "pt") as f:
        assert f.metadata()["recover_step"] == str(LAYOUT_STEPS)


def test_resume_with_another_model_is_refused(hf_run: Run, capsys: pytest.CaptureFixture[str],
                                              shards: Path, tmp_path: Path) -> None:
    """The model's identity is the trajectory's: a config that differs is named, nothing runs
    (the fingerprint that a joining replica must match is made of the same fields)."""
    wider = tiny_llama(tmp_path / "wider", hidden_size=48)
    code, _, err = cli(capsys, "train", "--out", str(hf_run.out), *LAYOUT_ARGS, "--replicas", "2",
                       *LAYOUT_FLAGS["hsdp"], "--data", str(shards), "--resume", "--model",
                       f"hf:{wider}")
    assert code == 2, err
    assert "model.hf_config.hidden_size" in err and len(err.strip().splitlines()) == 1, err


# -- in-process ----------------------------------------------------------------------------------
def resolved(name: str) -> RunConfig:
    cfg = RunConfig()
    cfg.model.name = name
    foreign.resolve(cfg.model)
    return cfg


def test_fingerprint_names_the_model(llama: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.json").write_text((llama / "config.json").read_text())
    prints = {name: fingerprint(resolved(name)) for name in (
        "gpt", f"hf:{llama}", f"hf:{tiny_llama(tmp_path / 'deeper', num_hidden_layers=3)}",
        f"{MODELS}:tiny_lm", "_foreign_models:tiny_lm")}
    assert len(set(prints.values())) == len(prints), prints
    assert fingerprint(resolved(f"hf:{moved}")) == prints[f"hf:{llama}"]  # content, not place


@pytest.mark.parametrize("name", ["hf", f"{MODELS}:tiny_lm", "_foreign_models:tiny_lm"])
def test_build_is_a_pure_function_of_config_and_seed(llama: Path, name: str) -> None:
    m = resolved(f"hf:{llama}" if name == "hf" else name).model
    rng = torch.get_rng_state()
    a, b, c = (foreign.build_lm(m, s).state_dict() for s in (7, 7, 8))
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is neither read nor moved
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert all(t.dtype == torch.float32 for t in a.values())


def test_decoder_layers_are_fsdp_units(llama: Path) -> None:
    hf = foreign.build_lm(resolved(f"hf:{llama}").model, 0)
    assert foreign.decoder_layers(hf) == list(hf.model.layers)
    own = foreign.build_lm(resolved(f"{MODELS}:tiny_lm").model, 0)
    assert foreign.decoder_layers(own) == list(own.layers)
    assert foreign.decoder_layers(torch.nn.Linear(2, 2)) == []  # then the whole model is one


@pytest.fixture(scope="module")
def bad_configs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    (root / "notjson").mkdir()
    (root / "notjson" / "config.json").write_text("{not json")
    (root / "alien").mkdir()
    (root / "alien" / "config.json").write_text('{"model_type": "no-such-model"}')
    tiny_llama(root / "smallvocab", vocab_size=100)
    tiny_llama(root / "short", max_position_embeddings=16)
    return root


@pytest.mark.parametrize("model, needle", [
    ("hf:{bad}/missing", "no such file"),
    ("hf:{bad}/notjson", "is not JSON"),
    ("hf:{bad}/alien", "knows no model_type 'no-such-model'"),
    ("hf:{bad}/smallvocab", "vocab_size 100 is smaller than the data's vocabulary (256"),
    ("hf:{bad}/short", "max_position_embeddings 16 is shorter than --block-size 64"),
    ("no_such_module_xyz:make", "no module named 'no_such_module_xyz'"),
    ("{bad}/none.py:make", "no such file"),
    ("{models}:nope", "has no 'nope'"),
    ("{models}:NOT_CALLABLE", "not a function"),
    ("{models}:not_a_module", "returned an object of type int, not a torch.nn.Module"),
    ("{models}:no_keywords", "calling it as f(vocab_size=256, block_size=64) failed"),
    ("{models}:flat_output", "its forward returned (1, 2), not logits"),
    ("justaname", "expected gpt, hf:PATH or module:function"),
])
def test_bad_model(capsys: pytest.CaptureFixture[str], tmp_path: Path, corpus: Path,
                   bad_configs: Path, model: str, needle: str) -> None:
    spec = model.format(bad=bad_configs, models=MODELS)
    code, _, err = cli(capsys, "train", "--out", str(tmp_path / "o"), "--data", str(corpus),
                       "--model", spec)
    assert code == 2, err
    assert needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_foreign_model_refuses_tp_and_pp(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                         llama: Path) -> None:
    for layout in ("tp", "pp"):
        code, _, err = cli(capsys, "train", "--out", str(tmp_path / "o"), "--model",
                           f"hf:{llama}", *LAYOUT_FLAGS[layout])
        assert code == 2 and "supports --layout plain and hsdp only" in err, err
        assert len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def no_ckpt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory whose run never saved a checkpoint."""
    d = tmp_path_factory.mktemp("nockpt")
    (d / "config.json").write_text(RunConfig().to_json())
    (d / rundir.RUN_TOKEN).write_text("t\n")
    return d


@pytest.mark.parametrize("argv, needle", [
    (["sample", "--run", "{missing}", "--prompt", "x"], "no such directory"),
    (["sample", "--run", "{empty}", "--prompt", "x"], "not a recover run directory"),
    (["sample", "--run", "{nockpt}", "--prompt", "x"], "no checkpoint that verifies"),
    (["sample", "--run", "{nockpt}", "--prompt", ""], "--prompt must not be empty"),
    (["sample", "--run", "{nockpt}", "--prompt", "x", "--temperature", "-1"],
     "--temperature must be in [0, 100] (got -1.0)"),
    (["sample", "--run", "{nockpt}", "--prompt", "x", "--top-k", "1.5"],
     "argument --top-k: invalid int value"),
    (["sample", "--run", "{nockpt}"], "the following arguments are required: --prompt"),
    (["export", "--run", "{missing}", "--out", "{out}"], "no such directory"),
    (["export", "--run", "{nockpt}", "--out", "{out}"], "no checkpoint that verifies"),
    (["export", "--run", "{nockpt}", "--out", "{nockpt}"], "exists"),
])
def test_sample_and_export_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                     no_ckpt_run: Path, argv: list[str], needle: str) -> None:
    places = dict(missing=tmp_path / "missing", empty=tmp_path, nockpt=no_ckpt_run,
                  out=tmp_path / "out.safetensors")
    code, _, err = cli(capsys, *(a.format(**places) for a in argv))
    assert code == 2, err
    assert needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.safetensors").exists()


def test_sample_decodes_with_the_prepared_tokenizer(tmp_path: Path) -> None:
    """A run on `recover prepare` shards (its data/meta.json names the folder) reads and writes
    text through that folder's tokenizer.json; a run without one, UTF-8 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from recover.app.sample import run_codec

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    shards, run = tmp_path / "shards", tmp_path / "run"
    shards.mkdir()
    (run / "data").mkdir(parents=True)
    tok.save(str(shards / "tokenizer.json"))
    (run / "data" / "meta.json").write_text(json.dumps({"prepared": str(shards)}))
    codec = run_codec(run, None)
    ids = codec.encode("the cat")
    assert ids == tok.encode("the cat").ids and len(ids) < len("the cat")
    assert codec.decode(ids) == "the cat" and codec.vocab == tok.get_vocab_size()
    (run / "data" / "meta.json").write_text(json.dumps({"source": "text"}))
    assert run_codec(run, None).encode("é") == [0xC3, 0xA9]  # bytes


def test_every_layout_reads_back_as_the_plain_model() -> None:
    """What `recover sample`/`export` read: a pipeline's stages (each numbering its blocks from 0,
    the tied head in the last) and TP's permuted q/k/v rows, put back in the plain GPT's names and
    order (plain and hsdp checkpoints already are: DCP joins FSDP2's shards)."""
    from recover.app.train.checkpoint.restore import plain_state
    from recover.app.train.parallelize import qkv_order

    cfg = RunConfig()
    cfg.model.n_layer = 4
    plain = foreign.build_lm(cfg.model, 0).state_dict()
    stages: dict[str, dict[str, torch.Tensor]] = {"stage0": {}, "stage1": {}}
    for k, t in plain.items():
        block = int(k.split(".")[1]) if k.startswith("blocks.") else None
        first = k.startswith(("wte.", "wpe.")) or (block is not None and block < 2)
        name = k if block is None else f"blocks.{block % 2}.{k.split('.', 2)[2]}"
        stages["stage0" if first else "stage1"][name] = t
    got = plain_state(stages, {"layout": "pp", "stages": 2}, cfg)
    assert got.keys() == plain.keys() and all(torch.equal(got[k], plain[k]) for k in plain)

    order = qkv_order(cfg.model.n_embd, 2)
    tp = {k: (t[order] if "c_attn" in k else t) for k, t in plain.items()}
    got = plain_state({"": tp}, {"layout": "tp", "tp": 2}, cfg)
    assert all(torch.equal(got[k], plain[k]) for k in plain)


def test_export_file_keeps_tied_weights_under_both_names(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from recover.app.export import save_state_file

    gpt = foreign.build_lm(RunConfig().model, 0)  # lm_head.weight is wte.weight
    save_state_file(gpt, tmp_path / "gpt.safetensors", {"format": "pt"})
    got = load_file(tmp_path / "gpt.safetensors")
    assert got.keys() == gpt.state_dict().keys()
    assert torch.equal(got["lm_head.weight"], got["wte.weight"])
    fresh = foreign.build_lm(RunConfig().model, 1)
    fresh.load_state_dict(got, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), gpt.parameters(),
                                                   strict=True))
