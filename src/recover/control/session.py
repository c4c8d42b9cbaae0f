"""The liveness session: a challenge-response hello, then a MAC on every line, both ways.

Invariant (a run with a token): a line is acted on only if it was sealed, for this connection,
by the holder of the run token, and is newer than every line accepted before on it. So a hello
captured from the wire cannot be replayed (the coordinator's nonce differs per connection), and
a relay between a member and the coordinator can drop or delay lines (as it can the connection)
but not inject, alter, reorder or replay one: not a `cut`, not a `ready`, not a `gen` push.

The wire (docs/DESIGN.md, "Store keys and the wire protocol"):
- on accept, the coordinator sends `challenge <nonce>` (32 hex, fresh per connection);
- the member's hello carries `proof = HMAC-SHA256(token, "recover-hello" 0 nonce 0 hello)` in hex,
  `hello` being the hello's words with the proof itself left out, space-joined;
- both then derive `key = HMAC-SHA256(token, "recover-session" 0 nonce 0 proof)`, and every line
  after the hello, each way (the hello's answer included), is `<line> ~<seq>.<tag>`: `seq` counts
  that direction's lines from 0, `tag = HMAC-SHA256(key, dir 0 seq 0 line)[:32 hex]`, `dir` `c`
  (coordinator to member) or `m`. A receiver takes a line only if its tag verifies and its `seq`
  is above the last one it took (a line lost to a full send buffer skips a number, harmlessly).
A hello whose proof does not verify is refused bare (its sender holds no key to check a sealed
answer with). Without a token there is no session: lines go bare, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_HEX = 32
TAG_HEX = 32
PROOF_AT = 5  # the proof's index among a hello's words


def nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def _hello_text(words: list[str]) -> bytes:
    return " ".join(words[:PROOF_AT] + words[PROOF_AT + 1:]).encode()


def hello_proof(token: str, challenge: str, words: list[str]) -> str:
    """The proof a hello's `words` carry at PROOF_AT, for the coordinator's `challenge`."""
    msg = b"recover-hello\x00" + challenge.encode() + b"\x00" + _hello_text(words)
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def proof_ok(token: str, challenge: str, words: list[str]) -> bool:
    """Whether a hello's proof is the one `hello_proof` gives (constant time)."""
    if len(words) <= PROOF_AT:
        return False
    return hmac.compare_digest(words[PROOF_AT].encode(),
                               hello_proof(token, challenge, words).encode())


class Session:
    """One side of a connection's sealed lines (`mine`: this side's direction letter)."""

    def __init__(self, token: str, challenge: str, proof: str, mine: str) -> None:
        msg = b"recover-session\x00" + challenge.encode() + b"\x00" + proof.encode()
        self._key = hmac.new(token.encode(), msg, hashlib.sha256).digest()
        self._mine, self._theirs = mine.encode(), (b"m" if mine == "c" else b"c")
        self._sent = 0
        self._taken = -1

    def _tag(self, way: bytes, seq: int, line: bytes) -> bytes:
        mac = hmac.new(self._key, way + b"\x00" + str(seq).encode() + b"\x00" + line,
                       hashlib.sha256)
        return mac.hexdigest()[:TAG_HEX].encode()

    def seal(self, msg: str) -> str:
        """`msg` (one or more lines, each ending in a newline) with each line sealed. The caller
        sends the result in this order (a member's threads hold its send lock over both)."""
        out = []
        for line in msg.split("\n")[:-1] if msg.endswith("\n") else msg.split("\n"):
            raw = line.encode()
            out.append(f"{line} ~{self._sent}.{self._tag(self._mine, self._sent, raw).decode()}\n")
            self._sent += 1
        return "".join(out)

    def open(self, line: bytes) -> bytes | None:
        """The line a sealed `line` carries (newline stripped), or None: its tag does not verify,
        or its number is not above the last one taken (a replay or reordering)."""
        body, sep, seal = line.rpartition(b" ~")
        seq_b, dot, tag = seal.partition(b".")
        if not sep or not dot or not seq_b.isdigit() or len(seq_b) > 18:
            return None
        seq = int(seq_b)
        if seq <= self._taken or not hmac.compare_digest(tag, self._tag(self._theirs, seq, body)):
            return None
        self._taken = seq
        return body
