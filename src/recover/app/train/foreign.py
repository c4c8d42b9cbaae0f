"""Every model `recover train` can train, behind one builder: recover's GPT (`--model gpt`), a
Hugging Face `transformers` causal LM from a local config.json (`--model hf:PATH`), or the user's
own `nn.Module` factory (`--model module:function`).

Invariant: as for the GPT (`recover.app.train.model`), a model is a pure function of
`(ModelConfig, seed)`: `build_lm` gives bitwise the same parameters for the same config and seed,
and neither reads nor advances the global RNG (construction runs under a forked RNG seeded by the
run seed). What a foreign model is enters the config once, at launch (`resolve`): an `hf:`
model's config.json as read (`ModelConfig.hf_config`, so the run directory alone rebuilds it, on
any host) and an identity (`hf:<sha256 of that config>`, `module:<spec>`); both are trajectory
fields, so they are in the fingerprint a joining replica must show and in what `--resume`
compares. Every model maps input ids `[B, T]` to logits `[B, T, V >= vocab]`; recover computes the
loss (mean cross-entropy over the B*T tokens, as the GPT does). A factory is called as
`factory(vocab_size=..., block_size=...)` and its module's forward as `module(ids)`, returning
logits (or a tuple whose first element is, or an object with `.logits`). Like `model.py`, this
module never imports the distributed package; `transformers` is imported only for `hf:` models.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recover.app.config import ModelConfig
from recover.app.train.model import build_model
from recover.errors import ConfigError

log = logging.getLogger(__name__)

INSTALL_HF = "pip install 'recover[hf]'"
# Where a causal LM keeps its decoder layers (Llama, Mistral, Qwen, Gemma: model.layers; GPT-2:
# transformer.h; GPT-NeoX: gpt_neox.layers; OPT: model.decoder.layers): FSDP2 shards each as one
# unit, so a layer's parameters are gathered just before it runs and freed after.
LAYER_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers",
               "transformer.blocks", "layers", "blocks", "h")

Logits = Callable[[nn.Module, Tensor], Tensor]
Loss = Callable[[nn.Module, Tensor, Tensor], Tensor]


def kind(name: str) -> str:
    """"gpt", "hf" or "module": which kind of model a `--model` value names."""
    if name == "gpt":
        return "gpt"
    return "hf" if name.startswith("hf:") else "module"


# -- resolving a --model value, at launch --------------------------------------------------------
def resolve(m: ModelConfig) -> ModelConfig:
    """Fill in `m.identity` (and for `hf:` the config it froze, `m.hf_config`) from `m.name`;
    ConfigError (one line) if the config.json, the module or the function cannot be found, or
    what they build is no causal LM (checked on the meta device: no memory, no RNG)."""
    k = kind(m.name)
    if k == "gpt":
        m.identity, m.hf_config = "gpt", None
    elif k == "hf":
        m.hf_config = read_hf_config(m.name[3:])
        # A causal LM transformers can build from this config: built on the meta device (no
        # memory, no RNG drawn), which also imports its modeling code for the fork server.
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            _hf_model(m)
        m.identity = "hf:" + config_digest(m.hf_config)
    else:
        check_factory(m)
        m.identity, m.hf_config = f"module:{m.name}", None
    return m


def read_hf_config(path: str) -> dict[str, Any]:
    """The JSON object in PATH/config.json (or PATH itself, a .json file)."""
    p = Path(path).expanduser()
    f = p / "config.json" if p.is_dir() else p
    where = f"--model hf:{path}"
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file: {f} (give a folder with a transformers "
                          "config.json, or the file)") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {f}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{where}: {f} is not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{where}: {f} is not a transformers model config (no model_type)")
    return data


def config_digest(hf_config: dict[str, Any]) -> str:
    """16 hex digits of an hf config's content (key order and whitespace do not count)."""
    text = json.dumps(hf_config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def transformers_module() -> Any:
    """`transformers`, offline (local files only), or a ConfigError saying how to install it."""
    # Set before the import: transformers and huggingface_hub read them once. A run never
    # downloads: a config is read from the path given, and weights start random.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"--model hf: needs transformers and safetensors: {INSTALL_HF}"
                          ) from None
    transformers.logging.set_verbosity_error()  # its warnings are about hub downloads we never do
    transformers.logging.disable_progress_bar()  # save_pretrained's bar: not our output
    return transformers


def hf_config_object(hf_config: dict[str, Any], where: str) -> Any:
    """The transformers config object of a causal LM, from the dict of its config.json."""
    tf = transformers_module()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hf_config["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"--model {where}: transformers {tf.__version__} knows no model_type "
                          f"{model_type!r}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"--model {where}: model_type {model_type!r} has no causal LM in "
                          f"transformers {tf.__version__} (AutoModelForCausalLM)")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(hf_config))
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"--model {where}: its config does not load: {e}") from None


def load_factory(spec: str) -> Callable[..., Any]:
    """The function `spec` names: `package.module:function` (importable here, or from the
    working directory) or `path/to/file.py:function`."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not all(p.isidentifier() for p in attr.split(".")):
        raise ConfigError(f"--model {spec!r}: expected gpt, hf:PATH or module:function")
    try:
        mod = _import_file(where) if where.endswith(".py") else _import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's module raised while it was imported: say what and where
        raise ConfigError(f"--model {spec}: importing {where} raised "
                          f"{type(e).__name__}: {e}") from None
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--model {spec}: {where} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"--model {spec}: {attr} is a {type(obj).__name__}, not a function")
    return obj


def _import_module(name: str) -> Any:
    # `recover` run as a console script has no working directory on sys.path (as `python -m`
    # has): a module beside the user's command must still import.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):  # the module itself, not one it imports
            raise ConfigError(f"--model {name}:...: no module named {name!r} (on the Python "
                              "path or in the working directory)") from None
        raise


def _import_file(path: str) -> Any:
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise ConfigError(f"--model {path}:...: no such file")
    name = "recover_user_model_" + hashlib.sha256(str(p).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--model {path}:...: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before running it: dataclasses and pickling look it up there
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


# -- building ------------------------------------------------------------------------------------
def build_lm(m: ModelConfig, seed: int) -> nn.Module:
    """A freshly initialised model of the run, bitwise the same for the same `(m, seed)`, in
    float32 on CPU, built under a forked RNG (the global one is neither read nor advanced)."""
    k = kind(m.name)
    if k == "gpt":
        return build_model(m, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _hf_model(m) if k == "hf" else _factory_model(m)


def _hf_model(m: ModelConfig) -> nn.Module:
    if m.hf_config is None:
        raise ConfigError(f"--model {m.name}: the run's config.json holds no hf_config")
    conf = hf_config_object(m.hf_config, m.name)
    from transformers import AutoModelForCausalLM

    # float32: parameters and optimizer state stay fp32 (autocast does the rest, --dtype), whatever
    # dtype the config names; sdpa: no kernel looked up anywhere.
    try:
        return AutoModelForCausalLM.from_config(conf, dtype=torch.float32,
                                                attn_implementation="sdpa")
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # a config it cannot build
        raise ConfigError(f"--model {m.name}: transformers cannot build it: "
                          f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None


def _factory_model(m: ModelConfig) -> nn.Module:
    factory = load_factory(m.name)
    try:
        model = factory(vocab_size=m.vocab_size, block_size=m.block_size)
    except TypeError as e:
        raise ConfigError(f"--model {m.name}: calling it as f(vocab_size={m.vocab_size}, "
                          f"block_size={m.block_size}) failed: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {m.name}: returned an object of type "
                          f"{type(model).__name__}, not a torch.nn.Module")
    return model


def check_fits(m: ModelConfig, data_vocab: int) -> None:
    """ConfigError unless an hf model can train on the run's data: its config's vocabulary holds
    every token of the data, and its positions the block size."""
    if kind(m.name) != "hf":
        return  # a factory is handed the data's vocabulary (ModelConfig.vocab_size)
    text = hf_config_object(m.hf_config or {}, m.name).get_text_config()
    vocab, positions = getattr(text, "vocab_size", None), getattr(
        text, "max_position_embeddings", None)
    if isinstance(vocab, int) and vocab < data_vocab:
        raise ConfigError(f"--model {m.name}: its vocab_size {vocab} is smaller than the "
                          f"data's vocabulary ({data_vocab} tokens)")
    if isinstance(positions, int) and positions < m.block_size:
        raise ConfigError(f"--model {m.name}: max_position_embeddings {positions} is "
                          f"shorter than --block-size {m.block_size}")


def check_factory(m: ModelConfig) -> None:
    """ConfigError unless `m.name`'s factory imports, takes (vocab_size, block_size), returns a
    module and that module's forward gives logits `[B, T, >= vocab]`: built and run on the meta
    device (no memory, no RNG drawn; a forward with an op the meta device lacks is not checked
    here, and a wrong output then stops the replicas with the same line)."""
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = _factory_model(m)
        try:
            out = model(torch.zeros(1, 2, dtype=torch.long))
        except Exception as e:  # an op without a meta kernel: the replicas will tell
            log.debug("--model %s: no meta-device forward to check (%s)", m.name, e)
            return
    logits_of(out, m.name, m.vocab_size)


def logits_of(out: Any, name: str, vocab: int) -> Tensor:
    """The logits in a foreign model's output: a tensor, `.logits`, or a tuple's first item;
    ConfigError (the run stops with one line) if that is no `[B, T, >= vocab]` tensor."""
    t = out.logits if hasattr(out, "logits") else (
        out[0] if isinstance(out, (tuple, list)) and out else out)
    if not isinstance(t, Tensor) or t.dim() != 3 or t.size(-1) < vocab:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ConfigError(f"--model {name}: its forward returned {got}, not logits "
                          f"[batch, tokens, >= {vocab}]")
    return t


def logits_fn(m: ModelConfig) -> Logits:
    """(model, ids [B, T]) -> logits [B, T, V], for the run's kind of model."""
    k = kind(m.name)
    if k == "gpt":
        return lambda model, x: model(x)[0]
    if k == "hf":  # no KV cache: training and our sampler feed whole windows
        return lambda model, x: model(input_ids=x, use_cache=False).logits
    return lambda model, x: logits_of(model(x), m.name, m.vocab_size)


def loss_fn(m: ModelConfig) -> Loss:
    """(model, x, y) -> mean cross-entropy over the microbatch's B*T tokens."""
    if kind(m.name) == "gpt":
        return lambda model, x, y: model(x, y)[1]  # the GPT's own loss, the trajectory's
    logits = logits_fn(m)

    def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        z = logits(model, x)
        return F.cross_entropy(z.reshape(-1, z.size(-1)), y.reshape(-1))

    return loss


def seeded_forward(m: ModelConfig) -> bool:
    """Whether a microbatch's forward must run on an RNG seeded by its id: the GPT's when it has
    dropout; a foreign model's always (its dropout is its own config's, unknown here; seeding
    has a cost per microbatch: docs/MEASUREMENTS.md, "Threads and start-up")."""
    return m.dropout > 0 if kind(m.name) == "gpt" else True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """A foreign model's decoder layers (FSDP2's units), or [] (then the whole model is one)."""
    for path in LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return list(obj)
    return []


def preload(m: ModelConfig) -> tuple[str, ...]:
    """Modules the launch's fork server should import for this model (each replica then does
    not import transformers again: seconds per process)."""
    if kind(m.name) != "hf" or m.hf_config is None:
        return ()
    t = m.hf_config["model_type"]
    return ("transformers", f"transformers.models.{t}.modeling_{t}")
