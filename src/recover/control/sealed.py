"""Store values a tokenless process cannot forge: a MAC keyed by the run token, bound to its key.

Invariant: `open_value(token, key, seal(token, key, value))` returns `value`; any other bytes
(a value written without the token, one copied from another key or another run, a truncated or
altered one) return None, never raise. A reader treats None as "absent" and logs it once per key
(rate-limited), so a forged value can at worst delay what waits for the real one.

Format: `value || b"|" || hex(HMAC-SHA256(k, key || 0x00 || value))[:32]`, where `k` is
HMAC-SHA256(token, "recover-store"): the token itself never keys two purposes. Without a token
(`token` None or empty) values are stored bare and returned as they are: a run without a token
has no authenticated control plane, by the user's choice (DESIGN.md, "Trust").
Counters cannot be sealed (`add` sums bytes as integers): their names are (`hidden`).
Sizes: no value over MAX_VALUE is sealed (recover's own are far smaller) nor opened (one is a
stranger's: refused before its MAC or its parsing costs anything). torch's store server still
holds whatever a client sets: that memory is the network policy's to bound (DESIGN.md, "Trust").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

log = logging.getLogger(__name__)

_TAG_HEX = 32  # 128 bits of the tag, hex: plenty against forgery, short on the wire
_SEP = b"|"
_PURPOSE = b"recover-store"
_LOG_EVERY_S = 10.0
# Bytes of a value recover seals or opens: its largest (a run's identity) is far smaller, and
# torch's store server refuses one over 8 MiB (it resets the connection).
MAX_VALUE = 4 << 20
_last_logged: dict[str, float] = {}


def _key_for(token: str) -> bytes:
    return hmac.new(token.encode(), _PURPOSE, hashlib.sha256).digest()


def _tag(token: str, key: str, value: bytes) -> bytes:
    mac = hmac.new(_key_for(token), key.encode() + b"\x00" + value, hashlib.sha256)
    return mac.hexdigest()[:_TAG_HEX].encode()


def seal(token: str | None, key: str, value: bytes) -> bytes:
    """`value` as stored under `key`: with its MAC when the run has a token. One over
    MAX_VALUE is recover's own bug (no reader would take it): ValueError."""
    if len(value) > MAX_VALUE:
        raise ValueError(f"{key}: a value of {len(value)} bytes is over {MAX_VALUE} (readers "
                         "refuse it)")
    if not token:
        return value
    return value + _SEP + _tag(token, key, value)


def open_value(token: str | None, key: str, raw: bytes | None) -> bytes | None:
    """The value `seal` stored under `key`, or None when `raw` is absent or not authentic."""
    if raw is None or not raw:
        return None
    if len(raw) > MAX_VALUE + len(_SEP) + _TAG_HEX:
        rejected(key, f"{len(raw)} bytes, over {MAX_VALUE} (none of recover's is)")
        return None
    if not token:
        return raw
    value, sep, tag = raw.rpartition(_SEP)
    if sep and len(tag) == _TAG_HEX and hmac.compare_digest(tag, _tag(token, key, value)):
        return value
    rejected(key, "its MAC does not verify (written without the run token)")
    return None


def hidden(token: str | None, key: str) -> str:
    """`key`, made unguessable without the token: `key/<64-bit tag>` (as is without a token).
    For counters (`add`), which cannot carry a MAC: TCPStore lists no keys, so a process without
    the token cannot add to one it cannot name (one that reads the traffic can: DESIGN.md)."""
    if not token:
        return key
    tag = hmac.new(_key_for(token), b"name\x00" + key.encode(), hashlib.sha256).hexdigest()
    return f"{key}/{tag[:16]}"


def rejected(key: str, why: str) -> None:
    """Log a refused store value once per key per interval: a flood of forgeries costs one line
    per key every `_LOG_EVERY_S`, never the disk."""
    now = time.monotonic()
    if now - _last_logged.get(key, -_LOG_EVERY_S) >= _LOG_EVERY_S:
        if len(_last_logged) > 4096:
            _last_logged.clear()
        _last_logged[key] = now
        log.warning("ignored the store's value of %s: %s", key, why)
