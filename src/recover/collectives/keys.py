"""Store key layout and wire messages shared by the coordinator and its members.

Invariant: generation `g`'s member list lives at `gen/{g}/members`, is written exactly once (by the
coordinator, with compare-and-set), and is published by incrementing `gen/count` only after it is
written; so a reader that sees `gen/count > g` can always read generation g's members.
"""

from __future__ import annotations

import datetime
import json

from torch.distributed import TCPStore

GEN_COUNT = "gen/count"  # number of generations published; the newest is count - 1
LIVENESS_ADDR = "coord/liveness"  # host:port of the coordinator's liveness socket
COORD_ERROR = "coord/error"  # set when the coordinator gives up (e.g. nobody joined)
COORD_STALE_S = "coord/stale_s"  # the coordinator's --stale-s: members derive their fence bound
COORD_EXITS = "coord/exits"  # JSON {replica: how the coordinator saw it end} (launcher summary)

EXIT_FENCED = 3  # a process fenced out of the newest generation exits with this code
# A process that heard nothing from the coordinator for its bound (a lasting network partition,
# or the coordinator's host gone) exits with this code; by then the coordinator has dropped it.
EXIT_PARTITIONED = 6


def members_key(g: int) -> str:
    return f"gen/{g}/members"


def heartbeat_key(replica: int, rank: int) -> str:
    return f"hb/{replica}.{rank}"


def gloo_addr(prefix: str, rank: int) -> str:
    """The address a rank's gloo device binds in one communicator (`prefix` = gen{g}/pos{p})."""
    return f"{prefix}/addr/{rank}"


def encode_members(members: list[int]) -> bytes:
    return json.dumps(sorted(members)).encode()


def decode_members(raw: bytes) -> list[int]:
    return [int(m) for m in json.loads(raw)]


def connect_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A client of the coordinator's TCPStore; raises ConnectionError with a readable message."""
    try:
        return TCPStore(host, port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # torch raises DistNetworkError / RuntimeError with C++ context
        raise ConnectionError(f"cannot reach the recover coordinator at {host}:{port}: "
                              f"{str(e).splitlines()[0]}") from None


def store_int(store: TCPStore, key: str) -> int:
    """Read an integer counter without blocking (add 0 creates it as 0 if missing)."""
    return int(store.add(key, 0))


_ABSENT = "\x00recover:absent"  # a value recover never stores


def try_get(store: TCPStore, key: str) -> bytes | None:
    """Non-blocking get in one round trip: None when the key does not exist yet.

    compare_set with an expected value that is never stored changes nothing and returns the
    current value, or the expected value itself when the key is missing (measured on torch 2.13).
    """
    v = store.compare_set(key, _ABSENT, _ABSENT)
    return None if v == _ABSENT.encode() else v
