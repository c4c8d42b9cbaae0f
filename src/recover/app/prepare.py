"""`recover prepare INPUT... --out DIR`: a corpus into recover's token shards. No network, ever.

Invariant: DIR appears complete or not at all: shards are written into a private sibling folder,
`meta.json` last, then renamed into place; its contents are a pure function of the inputs (in the
order given, a folder's files sorted), the tokenizer (its sha256 is in meta.json) and the flags,
whatever the number of worker processes (their results are written in submission order). Every
user mistake (a missing or unreadable input, an empty corpus, a tokenizer that does not load, a
bad vocabulary size, a missing optional dependency) is one line and exit 2.

The val split is the corpus's last `--val-fraction` of tokens (a document may straddle it). Each
document ends with the tokenizer's end-of-text token when it has one (meta.json's `eos_id`).
Reading the inputs, in pieces that bound memory: `recover.app.prepare_sources`; tokenising them
into shards: `recover.app.prepare_tokens`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from recover.app.prepare_sources import find_sources, texts
from recover.app.prepare_tokens import (
    BYTES,
    Shard,
    ShardWriter,
    Tokenization,
    load_tokenizer,
    tokenize_into,
    train_tokenizer,
)
from recover.data.tokens import DTYPES, FORMAT, FORMAT_VERSION, META, token_dtype
from recover.errors import ConfigError, DataError, ExitCode, RecoverError, UsageParser, usage_line
from recover.settings import Bounds

log = logging.getLogger(__name__)
MAX_VOCAB = 1 << 32  # uint32 token ids
MIN_TRAINED_VOCAB = 257  # the 256 bytes of byte-level BPE + <|endoftext|>
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}


def check_out(out: Path) -> None:
    """ConfigError unless `out` is absent or an empty folder (a corpus is never mixed into
    another, nor written over one)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty folder: prepare into "
                          "a new one")


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenise `args.inputs` into `args.out` (see the module); meta.json's contents."""
    out = Path(args.out).expanduser()
    check_out(out)
    sources = find_sources(args.inputs)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise DataError(f"--out {out}: cannot create a folder beside it: {e.strerror or e}"
                        ) from None
    try:
        if args.tokenizer:
            tz = load_tokenizer(args.tokenizer, tmp)
        elif args.train_tokenizer:
            log.info("training a byte-level BPE of %d tokens on the corpus", args.train_tokenizer)
            tz = train_tokenizer(args.train_tokenizer, texts(sources, args.text_field), tmp)
        else:
            tz = BYTES
        writer = ShardWriter(tmp, token_dtype(tz.vocab_size), args.shard_tokens)
        tokenize_into(sources, args.text_field, tz, writer, args.workers)
        if writer.tokens < 2:
            raise DataError(f"the inputs hold {'no' if not writer.tokens else 'too little'} text "
                            f"({', '.join(args.inputs)}): nothing to train on")
        shards = writer.split_val(args.val_fraction)
        meta = _meta(args, tz, writer, shards)
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (check_out)
        os.replace(tmp, out)
    except OSError as e:
        raise DataError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when it was renamed
    return meta


def _meta(args: argparse.Namespace, tz: Tokenization, writer: ShardWriter,
          shards: list[Shard]) -> dict[str, Any]:
    splits = {s: {"documents": sum(x.documents for x in shards if x.split == s),
                  "tokens": sum(x.tokens for x in shards if x.split == s)}
              for s in ("train", "val")}
    return {"format": FORMAT, "version": FORMAT_VERSION,
            "dtype": next(k for k, v in DTYPES.items() if v == writer.dtype),
            "vocab_size": tz.vocab_size, "eos_id": tz.eos_id, "tokenizer": tz.meta,
            "inputs": [str(Path(i).expanduser().resolve()) for i in args.inputs],
            "text_field": args.text_field, "val_fraction": args.val_fraction,
            "splits": splits, "shards": [s.entry() for s in shards]}


def _bounded(kind: type, bounds: Bounds) -> Any:
    """An argparse type: a number of `kind` within `bounds`, else argparse's one-line error."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
            bounds.check("value", value, kind is int)
        except (ValueError, ConfigError):
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what} {bounds.describe()} "
                                             f"(got {text!r})") from None
        return value
    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="recover prepare", description=(
        "Tokenise local text (.txt, .md), JSONL, Parquet files or a saved `datasets` folder into "
        "recover's token shards (uint16 up to 65,536 tokens, else uint32) for "
        "`recover train --data DIR`. Never uses the network."))
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files or folders, in this order")
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", metavar="FILE",
                     help="a local Hugging Face tokenizer.json (or a folder holding one)")
    how.add_argument("--train-tokenizer", metavar="VOCAB",
                     type=_bounded(int, Bounds(MIN_TRAINED_VOCAB, MAX_VOCAB)),
                     help="train a byte-level BPE of at most VOCAB tokens on the corpus")
    how.add_argument("--bytes", action="store_true", help="UTF-8 bytes (vocabulary 256)")
    p.add_argument("--text-field", default="text",
                   help="the text field of JSONL, Parquet and dataset rows (default: text)")
    p.add_argument("--val-fraction", type=_bounded(float, Bounds(0.0, 0.5, True, True)),
                   default=0.05, help="last fraction of the tokens held out (default: 0.05)")
    p.add_argument("--shard-tokens", type=_bounded(int, Bounds(1, 1 << 40)),
                   default=100_000_000, help="tokens per shard, about (default: 100,000,000)")
    p.add_argument("--workers", type=_bounded(int, Bounds(1, 1024)), default=os.cpu_count() or 1,
                   help="tokenising processes (default: every core)")
    return p


def run_cli(argv: list[str]) -> int:
    """`recover prepare`: one summary line on stdout, or one error line on stderr and exit 2."""
    args = build_parser().parse_args(argv)
    os.environ.update(OFFLINE)  # before datasets or tokenizers is imported: never the network
    try:
        meta = prepare(args)
    except RecoverError as e:
        return usage_line("recover prepare", e)
    except KeyboardInterrupt:  # the pool and the half-written folder are gone already
        print("recover prepare: interrupted", file=sys.stderr)
        return 130
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    print(f"recover prepare: {tr['tokens']:,} train tokens ({tr['documents']:,} documents) and "
          f"{va['tokens']:,} val tokens in {len(meta['shards'])} {meta['dtype']} shards, "
          f"vocabulary {meta['vocab_size']:,}: {args.out}", flush=True)
    return ExitCode.OK
