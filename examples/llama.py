"""A small Llama from `transformers`, trained by `recover train` with faults, end to end.

Invariant: every step is recover's own command line, as a user types it (no recover internals);
what one step writes is the next step's input, all under one work folder:

    1. llama/config.json   a tiny LlamaConfig (random init: no weights are downloaded)
    2. shards/             `recover prepare`: a text, a byte-level BPE trained on it, token shards
    3. run/                `recover train --model hf:llama --data shards`, 3 replicas; replica 1 is
                           killed mid-backward at step 10 and restarted at step 20 (it rejoins by
                           state transfer), replica 2 hangs at step 30 (it is fenced); then the
                           failure-free reference, whose losses the run's match within 1e-5
    4. `recover sample`    text from the newest checkpoint that verifies, through the tokenizer
    5. export/             `recover export`: a transformers folder `from_pretrained` loads

    pip install -e '.[hf,data]'
    python examples/llama.py --work /tmp/llama-demo      # a few minutes on a laptop CPU

Each command is bounded (`--timeout-s`); a failing one stops the example with its exit code.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("example")


def recover(*argv: str, timeout_s: float) -> None:
    """`recover ARGV...`, as a user runs it; its output passes through."""
    cmd = [sys.executable, "-m", "recover", *argv]
    log.info("$ recover %s", " ".join(argv))
    done = subprocess.run(cmd, timeout=timeout_s, check=False)
    if done.returncode != 0:
        sys.exit(done.returncode)


def write_config(folder: Path, vocab: int, block_size: int) -> None:
    """A Llama a CPU trains in minutes: 4 layers of width 128, grouped-query attention."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=block_size).save_pretrained(folder)


def write_corpus(path: Path) -> None:
    """Any text will do: here recover's embedded corpus (Shakespeare's plays)."""
    from recover.app.train.data import default_corpus

    source, text = default_corpus()
    path.write_bytes(text)
    log.info("corpus: %s, %d bytes", source, len(text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("llama-demo"), help="the work folder")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary (default: 2048)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default: 60)")
    ap.add_argument("--timeout-s", type=float, default=3600.0,
                    help="bound of each command (default: 3600)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a.work.mkdir(parents=True, exist_ok=True)
    block, t = 128, a.timeout_s
    write_corpus(a.work / "corpus.txt")
    recover("prepare", str(a.work / "corpus.txt"), "--train-tokenizer", str(a.vocab),
            "--out", str(a.work / "shards"), timeout_s=t)
    write_config(a.work / "llama", a.vocab, block)
    recover("train", "--model", f"hf:{a.work / 'llama'}", "--data", str(a.work / "shards"),
            "--out", str(a.work / "run"), "--replicas", "3", "--steps", str(a.steps),
            "--block-size", str(block), "--lr", "1e-3", "--min-lr", "1e-4", "--eval-every", "20",
            "--fault", f"kill:replica=1,step={a.steps // 6},phase=backward",
            "--fault", f"restart:replica=1,step={a.steps // 3}",
            "--fault", f"hang:replica=2,step={a.steps // 2},seconds=4", "--reference",
            timeout_s=t)
    recover("sample", "--run", str(a.work / "run"), "--prompt", "ROMEO:",
            "--max-new-tokens", "60", timeout_s=t)
    recover("export", "--run", str(a.work / "run"), "--out", str(a.work / "export"), timeout_s=t)
    log.info("load it without recover: AutoModelForCausalLM.from_pretrained(%r)",
             str(a.work / "export"))


if __name__ == "__main__":
    main()
