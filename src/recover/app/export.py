"""`recover export --run DIR --out PATH`: a trained run's newest verified checkpoint as files that
load without recover.

Invariant: the exported parameters are the checkpoint's, bitwise
(`recover.app.train.checkpoint.restore`, any layout). A `gpt` or `module:` model becomes one
safetensors file holding every entry of the model's state_dict (a tied weight under each of its
names, so `load_state_dict` takes it whole), with the run's model config in its metadata; an `hf:`
model becomes a `transformers` folder (`save_pretrained`: config.json and model.safetensors; the
run's tokenizer.json beside them) that `from_pretrained` loads. Nothing is overwritten: PATH must
not exist, and it appears by one rename, whole or not at all. A bad flag, run directory or
checkpoint is one line and exit 2. """

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from recover.errors import ConfigError, RecoverError, UsageParser, usage_line

PROG = "recover export"


def parser() -> UsageParser:
    ap = UsageParser(prog=PROG, description="Write a recover train run's newest checkpoint that "
                     "verifies as one safetensors file (gpt, module: models) or a transformers "
                     "folder (hf: models).")
    ap.add_argument("--run", required=True, metavar="DIR", help="the run directory")
    ap.add_argument("--out", required=True, metavar="PATH",
                    help="the file (or, for hf: models, folder) to write; must not exist")
    return ap


def run_cli(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        out, what = export(args.run, args.out)
    except RecoverError as e:
        return usage_line(PROG, e)
    print(f"{PROG}: wrote {out} ({what})", flush=True)
    return 0


def export(run_dir: str, out: str) -> tuple[Path, str]:
    """Write `run_dir`'s newest verified checkpoint to `out`; (out, what was written)."""
    from recover.app.train import foreign
    from recover.app.train.checkpoint.restore import load_run, run_config

    dest = Path(out).expanduser()
    if os.path.lexists(dest):
        raise ConfigError(f"--out {out} exists: nothing is overwritten; choose another path")
    cfg = run_config(run_dir)
    hf = foreign.kind(cfg.model.name) == "hf"
    _need_safetensors()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write in {dest.parent}: {e.strerror or e}"
                          ) from None
    try:
        res = load_run(run_dir)
        if hf:
            _save_hf(res.model, tmp, Path(run_dir), cfg.data.path)
            os.rename(tmp, dest)
        else:
            save_state_file(res.model, tmp / "model.safetensors", _metadata(res))
            os.rename(tmp / "model.safetensors", dest)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write it: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = sum(p.numel() for p in res.model.parameters())
    kind = "transformers folder" if hf else "safetensors"
    return dest, f"{kind}, {n:,} parameters, step {res.step} of {run_dir}"


def _need_safetensors() -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ConfigError("recover export writes safetensors: pip install 'recover[hf]'"
                          ) from None


def _metadata(res: Any) -> dict[str, str]:
    """safetensors' string metadata: enough to rebuild the model (recover's GPT: its shape)."""
    return {"format": "pt", "recover_step": str(res.step),
            "recover_model": json.dumps(
                {k: v for k, v in vars(res.cfg.model).items() if k != "hf_config"},
                sort_keys=True)}


def save_state_file(model: Any, path: Path, metadata: dict[str, str]) -> None:
    """Every state_dict entry, each its own contiguous tensor: safetensors refuses tensors that
    share memory, so a tied weight's second name gets a copy (equal, bitwise)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        key = t.untyped_storage().data_ptr()
        tensors[name] = t.clone().contiguous() if key in seen else t.contiguous()
        seen.add(key)
    save_file(tensors, str(path), metadata=metadata)


def _save_hf(model: Any, folder: Path, run_dir: Path, data_path: str | None) -> None:
    """`save_pretrained` (safetensors), and the run's tokenizer.json if it has one."""
    from recover.app.sample import TOKENIZER, run_codec

    model.save_pretrained(str(folder))  # safetensors: the only format transformers 5 writes
    codec = run_codec(run_dir, data_path)
    if codec.tokenizer is not None:
        codec.tokenizer.save(str(folder / TOKENIZER))
