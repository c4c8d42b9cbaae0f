"""The state stream (`transfer.send` / `receive` over a `channel` session), in threads.

Frames are decrypted straight into the joiner's tensors (no staging copy of the state): every
kind of destination arrives bitwise (multi-frame, empty, strided, bf16, bool), and a donor that
goes away mid-stream fails the joiner at once, not at a timeout.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from recover.control import CoordinatorGone
from recover.replica import channel, rejoin, transfer

pytestmark = pytest.mark.timeout(60)
KEY, CTX = b"a run token", channel.context(2, 0)


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(transfer.CHUNK // 4 + 1000, generator=g)  # two frames, the last short
    strided = torch.randn(40, 30, generator=g).t()  # not contiguous: a host buffer, copied in
    return [("a/big", big), ("b/empty", torch.empty(0, 3)),
            ("c/strided", strided), ("d/bf16", torch.randn(17, generator=g).bfloat16()),
            ("e/bool", torch.rand(9, generator=g) > 0.5),
            ("f/step", torch.tensor([seed], dtype=torch.int64))]


def _pair(timeout_s: float) -> tuple[channel.Session, socket.socket, threading.Thread,
                                     list[channel.Session]]:
    """A joiner session connected to a donor session (handed over in the list once greeted)."""
    srv = socket.create_server(("127.0.0.1", 0))
    donors: list[channel.Session] = []

    def greet() -> None:
        with srv:
            s = channel.accept(srv, KEY, CTX, 10)
            s.sock.settimeout(timeout_s)
            donors.append(s)

    t = threading.Thread(target=greet, daemon=True)
    t.start()
    sock = socket.create_connection(srv.getsockname()[:2], timeout=timeout_s)
    joiner = channel.join(sock, KEY, CTX)
    t.join(10)
    return joiner, sock, t, donors


def test_every_kind_of_tensor_arrives_bitwise() -> None:
    want, mine = _tensors(0), _tensors(1)
    live = mine[2][1]  # the joiner's own strided tensor: written through, not replaced
    joiner, sock, _, donors = _pair(10)
    sent: list[int] = []
    donor = threading.Thread(target=lambda: sent.append(
        transfer.send(donors[0], want, {"x": 1})), daemon=True)
    with sock, donors[0].sock:
        donor.start()
        meta, got = transfer.receive(joiner, mine, {})
        donor.join(10)
    assert meta == {"x": 1} and sent == [got] == [sum(t.numel() * t.element_size()
                                                     for _, t in want)]
    for (p, a), (_, b) in zip(want, mine, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), p
    assert mine[2][1] is live and torch.equal(live, want[2][1])


def test_a_donor_gone_mid_stream_fails_the_joiner_at_once() -> None:
    """The donor sends the header and one frame of two, then closes: the reader thread sees the
    end of the stream and the joiner raises well within the socket's 30 s timeout."""
    want, mine = _tensors(0), _tensors(1)
    joiner, sock, _, donors = _pair(30)
    d = donors[0]
    header = {"meta": {}, "tensors": [(p, str(t.dtype), list(t.shape)) for p, t in want]}

    def donate_part() -> None:
        with d.sock:
            d.send(json.dumps(header).encode())
            d.send(memoryview(want[0][1].numpy()).cast("B")[:transfer.CHUNK])

    donor = threading.Thread(target=donate_part, daemon=True)
    t0 = time.monotonic()
    donor.start()
    with sock, pytest.raises(channel.ChannelError, match="went away"):
        transfer.receive(joiner, mine, {})
    donor.join(10)
    assert time.monotonic() - t0 < 10


class _ResetStore:
    """A store client whose coordinator just died: every call fails as torch's client does."""

    def compare_set(self, *_: object) -> bytes:
        raise torch.distributed.DistNetworkError("Connection reset by peer")


def test_a_joiner_whose_store_breaks_asks_for_the_restarted_coordinator() -> None:
    """The store's connection breaks while a joiner waits for its donor (the coordinator died,
    before the liveness socket says so): `CoordinatorGone`, which the app answers by joining the
    restarted coordinator, not a traceback from inside torch (a soak run's joiner exited 1 so,
    and the others waited 60 s for it at the boundary its restart was scheduled for)."""
    member = SimpleNamespace(token="t", replica=3, join_epoch=1, store=_ResetStore(),
                             coordinator_lost=False, run_over=False)
    with pytest.raises(CoordinatorGone, match="store's connection broke while it joined"):
        rejoin.receive(member, 0, nn.Linear(2, 2), None, {}, None, 5.0)  # type: ignore[arg-type]
