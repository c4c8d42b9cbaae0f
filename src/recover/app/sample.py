"""`recover sample --run DIR --prompt TEXT`: text from a trained run's newest verified checkpoint.

Invariant: what is printed is a pure function of (the checkpoint, the prompt, the flags): the model
is the checkpoint's, bitwise (`recover.app.train.checkpoint.restore`, any layout), every draw comes
from a generator seeded by `--seed` (the global RNG is not touched), and the context is the last
block_size tokens, the length the run trained on. Text goes through the tokenizer the run's data
came with (a `tokenizer.json` in its data folder) or, without one, is UTF-8 bytes; a token outside
that vocabulary is never drawn. A bad flag, run directory or checkpoint is one line on stderr and
exit 2, never a traceback. """

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recover.app import rundir
from recover.errors import ConfigError, RecoverError, UsageParser, usage_line
from recover.settings import Bounds, Number

PROG = "recover sample"
BYTES = 256
MAX_NEW = Bounds(1, 1 << 20)
TEMPERATURE = Bounds(0.0, 100.0)  # 0: greedy (the most likely token, no draw)
TOP_K = Bounds(0, 1 << 32)  # 0: every token of the vocabulary
SEED = Bounds(0, (1 << 63) - 1)
TOKENIZER = "tokenizer.json"


def parser() -> UsageParser:
    ap = UsageParser(prog=PROG, description="Print text sampled from a recover train run's newest "
                     "checkpoint that verifies (any layout; a byte model reads and writes UTF-8).")
    ap.add_argument("--run", required=True, metavar="DIR", help="the run directory")
    ap.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    ap.add_argument("--max-new-tokens", type=Number(int, MAX_NEW), default=200,
                    help="tokens to generate (default: 200)")
    ap.add_argument("--temperature", type=Number(float, TEMPERATURE), default=0.8,
                    help="softmax temperature; 0: always the most likely token (default: 0.8)")
    ap.add_argument("--top-k", type=Number(int, TOP_K), default=200,
                    help="draw among the k most likely tokens; 0: all (default: 200)")
    ap.add_argument("--seed", type=Number(int, SEED), default=1337,
                    help="seed of the draws: the same seed, the same text (default: 1337)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model runs (default: cpu)")
    return ap


@dataclass
class Sampling:
    """How tokens are drawn."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 200
    seed: int = 1337


class Codec:
    """Text <-> token ids: a `tokenizers` tokenizer, or UTF-8 bytes (`tokenizer` None)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vocab = tokenizer.get_vocab_size() if tokenizer is not None else BYTES

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))


def run_cli(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        for flag, value, bounds, integer in (
                ("--max-new-tokens", args.max_new_tokens, MAX_NEW, True),
                ("--temperature", args.temperature, TEMPERATURE, False),
                ("--top-k", args.top_k, TOP_K, True), ("--seed", args.seed, SEED, True)):
            bounds.check(flag, value, integer)
        if not args.prompt:
            raise ConfigError("--prompt must not be empty: the model continues a text")
        text = sample(args.run, args.prompt, Sampling(args.max_new_tokens, args.temperature,
                                                      args.top_k, args.seed), args.device)
    except RecoverError as e:
        return usage_line(PROG, e)
    print(text, flush=True)
    return 0


def sample(run_dir: str, prompt: str, how: Sampling, device: str = "cpu") -> str:
    """The prompt and its continuation, from `run_dir`'s newest checkpoint that verifies."""
    import torch

    from recover.app.train import foreign
    from recover.app.train.checkpoint.restore import load_run, run_config

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible here")
    cfg = run_config(run_dir)
    codec = run_codec(Path(run_dir), cfg.data.path)
    if codec.tokenizer is None and cfg.model.vocab_size > BYTES:
        raise ConfigError(f"--run {run_dir} trained on token ids ({cfg.model.vocab_size} "
                          f"tokens) and no {TOKENIZER} is in its data folder: put the one its "
                          f"tokens came from into {Path(run_dir) / rundir.DATA}")
    ids = codec.encode(prompt)
    if not ids:
        raise ConfigError(f"--prompt {prompt!r} encodes to no tokens")
    res = load_run(run_dir)
    for line in res.skipped:
        print(f"{PROG}: {line}", file=sys.stderr)
    print(f"{PROG}: {res.path} (step {res.step})", file=sys.stderr)
    new = generate(res.model.to(device), foreign.logits_fn(res.cfg.model), ids, how,
                   min(codec.vocab, cfg.model.vocab_size), cfg.model.block_size)
    return codec.decode(ids + new)


def run_codec(run_dir: Path, data_path: str | None) -> Codec:
    """The run's tokenizer: the tokenizer.json of the `recover prepare` folder it trained on (the
    run's data/meta.json names it), or one in the run's own data folder; else bytes."""
    places = [run_dir / rundir.DATA / TOKENIZER]
    try:
        meta = rundir.read_json(run_dir / rundir.DATA / rundir.DATA_META)
    except OSError:  # unreadable: the run's own data folder is the last place to look anyway
        meta = None
    prepared = meta.get("prepared") if isinstance(meta, dict) else None
    for folder in (prepared, data_path):
        if isinstance(folder, str) and folder:
            places.append(Path(folder).expanduser() / TOKENIZER)
    found = next((p for p in places if p.is_file()), None)
    if found is None:
        return Codec()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"{found}: reading it needs the tokenizers package: "
                          "pip install 'recover[data]'") from None
    try:
        return Codec(Tokenizer.from_file(str(found)))
    except Exception as e:  # tokenizers raises its own Exception type on a malformed file
        raise ConfigError(f"{found} does not load as a tokenizer: {e}") from None


def generate(model: Any, logits_of: Callable[[Any, Any], Any], ids: list[int], how: Sampling,
             vocab: int, block_size: int) -> list[int]:
    """`how.max_new_tokens` tokens after `ids`, each drawn from the model's next-token
    distribution over the first `vocab` tokens (top-k, at the temperature; greedy at 0)."""
    import torch

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(how.seed)
    seq = torch.tensor([ids], dtype=torch.long, device=device)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(how.max_new_tokens):
            z = logits_of(model, seq[:, -block_size:])[:, -1, :vocab].float()
            if how.temperature == 0:
                nxt = z.argmax(dim=-1, keepdim=True)
            else:
                z = z / how.temperature
                if 0 < how.top_k < z.size(-1):
                    kth = torch.topk(z, how.top_k, dim=-1).values[:, -1:]
                    z = z.masked_fill(z < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(z, dim=-1), 1, generator=gen)
            seq = torch.cat([seq, nxt], dim=1)
            out.append(int(nxt))
    return out
