"""The state transfer's channel: a donor and a joiner that both hold the run token, and no one else.

The store has no authentication (docs/DESIGN.md, "Checkpoints, rejoin and trust"): anyone who
reaches it can read or replace the donor's published address, and connect to the donor's port.
So nothing on this channel is trusted for being where it is; it is trusted for being keyed by
the run token:

- the published address carries an HMAC-SHA256 (`sign_address` / `open_address`), so a swapped
  one is spotted before the joiner connects;
- before any state byte, a handshake binds a proof of the token to the join (its `context`: the
  join epoch and rank) and to two fresh nonces: the donor sends `MAGIC` and its nonce, the joiner
  answers its nonce and its proof, the donor checks it (constant time) and answers its own proof;
- the session keys (one AES-256-GCM key per direction) come from HKDF-SHA256 over the token with
  both nonces as the salt; every frame is sealed under a counter nonce with its index and
  direction bound in the associated data;
- bulk frames (`send_all`, `recv_all_into`) are sealed and opened through buffers kept for the
  call, a frame opened straight into its destination; the socket buffers have the next frame on
  the wire meanwhile.

Invariant: `Session.recv` returns a frame's plaintext (`recv_all_into` returns, its views
filled) only if a token holder sealed it in this session (these nonces, this join), in this
direction, at exactly this index: a relay can neither read, modify, reorder, drop nor replay a
frame, and anything else raises `ChannelError` (leaving `recv_all_into`'s views undefined). A peer
without the token gets from a donor its random nonce and nothing else (`accept` closes it and
keeps accepting until its deadline), and never a session.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from recover.deadline import Deadline
from recover.errors import RecoverError

MAGIC = b"RCVR-STATE-2\x00\x00\x00\x00"
LABEL = b"recover live state transfer v2"
NONCE = 32
PROOF = 32  # HMAC-SHA256
TAG = 16  # AES-GCM
HELLO_S = 5.0  # a connection that does not prove the token within this is dropped
POLL_S = 0.2  # how often a waiting donor looks whether its join is still wanted

log = logging.getLogger(__name__)


class ChannelError(RecoverError, RuntimeError):
    """The peer did not prove the run token, or a frame failed its authentication."""


def context(epoch: int, rank: int) -> bytes:
    """What a session is bound to: this purpose, this join epoch, this rank."""
    return LABEL + struct.pack("!qq", epoch, rank)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(struct.pack("!I", len(p)) + p for p in parts),
                    hashlib.sha256).digest()


# -- the published address -------------------------------------------------------------------
def sign_address(key: bytes, ctx: bytes, addr: str) -> bytes:
    """The store value that publishes `addr` ("host:port") for the join `ctx`."""
    return f"{addr} {_mac(key, b'address', ctx, addr.encode()).hex()}".encode()


def open_address(key: bytes, ctx: bytes, value: bytes) -> str:
    """The address a store value publishes, if a token holder signed it for this join."""
    addr, _, tag = value.partition(b" ")
    if not hmac.compare_digest(tag, _mac(key, b"address", ctx, addr).hex().encode()):
        raise ChannelError("the donor's published address is not signed with the run token "
                           "(written by a process without it)")
    return addr.decode("ascii", "replace")


# -- the session -----------------------------------------------------------------------------
class Session:
    """Sealed frames over a connected socket (u32 length, then the AES-GCM ciphertext)."""

    def __init__(self, sock: socket.socket, key: bytes, ctx: bytes, nonces: bytes,
                 donor: bool) -> None:
        okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=nonces,
                   info=b"session " + ctx).derive(key)
        to_joiner, to_donor = AESGCM(okm[:32]), AESGCM(okm[32:])
        self.sock, self.ctx = sock, ctx
        self._out, self._in = (to_joiner, to_donor) if donor else (to_donor, to_joiner)
        self._out_dir, self._in_dir = (b"J", b"D") if donor else (b"D", b"J")
        self._sent = self._got = 0
        self._wbuf = bytearray()  # `send`'s, grown to the largest frame

    def send(self, data: bytes | memoryview) -> None:
        """Seal and send one frame."""
        n = 4 + len(data) + TAG
        if len(self._wbuf) < n:
            self._wbuf = bytearray(n)
        self.sock.sendall(self._seal(data, memoryview(self._wbuf)[:n]))

    def send_all(self, parts: Iterable[memoryview]) -> None:
        """Seal and send each of `parts` as one frame, in order, through one buffer kept for
        the session (no copy beyond the cipher's output)."""
        for data in parts:
            self.send(data)

    def recv(self, limit: int) -> bytes:
        """The next frame's plaintext (at most `limit` bytes), authenticated."""
        n = self._length(limit)
        return self._open(recv_exact(self.sock, n), None)

    def recv_all_into(self, sizes: list[int], dests: Iterable[memoryview]) -> None:
        """Decrypt the next `len(sizes)` frames, of exactly those plaintext sizes, into the views
        `dests` yields (writable bytes, one per frame, taken as late as possible), each received
        into one buffer kept for the call. A frame that fails its authentication raises
        `ChannelError` and leaves its view's bytes undefined (AES-GCM decrypts before it checks
        the tag): the caller discards every view.

        One thread: while it opens frame k, the kernel's socket buffers take frame k + 1 from
        the donor. A reader thread (and a sender thread on the donor) makes it slower where the
        two processes share two cores, which they already keep busy (docs/MEASUREMENTS.md, "Live
        state transfer")."""
        buf = bytearray()
        for size, dest in zip(sizes, dests, strict=False):  # never one view too many
            n = self._length(size)
            if n != size + TAG or len(dest) != size:
                raise ChannelError(f"a frame of {n} bytes ({size + TAG} expected) for a view of "
                                   f"{len(dest)}")
            if len(buf) < n:
                buf = bytearray(n)
            sealed = memoryview(buf)[:n]
            recv_exact_into(self.sock, sealed)
            self._open(sealed, dest)

    def _seal(self, data: bytes | memoryview, out: memoryview) -> memoryview:
        """The next frame, its length then its ciphertext, written into `out` (its size)."""
        i, self._sent = self._sent, self._sent + 1
        struct.pack_into("!I", out, 0, len(out) - 4)
        self._out.encrypt_into(struct.pack("!4xQ", i), data, self._aad(self._out_dir, i),
                               out[4:])
        return out

    def _open(self, sealed: bytes | bytearray | memoryview, dest: memoryview | None
              ) -> bytes:
        """The next frame's plaintext (into `dest` when given: then b"")."""
        i, self._got = self._got, self._got + 1
        nonce, aad = struct.pack("!4xQ", i), self._aad(self._in_dir, i)
        try:
            if dest is None:
                return self._in.decrypt(nonce, sealed, aad)
            self._in.decrypt_into(nonce, sealed, aad, dest)
            return b""
        except InvalidTag:  # forged, modified, reordered or replayed
            raise ChannelError(f"frame {i} failed its authentication (modified, reordered or "
                               "not sealed with the run token)") from None

    def _length(self, limit: int) -> int:
        (n,) = struct.unpack("!I", recv_exact(self.sock, 4))
        if not TAG <= n <= limit + TAG:  # before allocating: a relay names any length
            raise ChannelError(f"a frame of {n} bytes (at most {limit + TAG} expected)")
        return n

    def _aad(self, direction: bytes, i: int) -> bytes:
        return self.ctx + direction + struct.pack("!Q", i)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Exactly `n` bytes (the socket's timeout bounds each read)."""
    out = bytearray(n)
    recv_exact_into(sock, memoryview(out))
    return out


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (the socket's timeout bounds each read)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelError("the peer went away during the transfer")
        got += k


# -- the handshake ---------------------------------------------------------------------------
def greet(conn: socket.socket, key: bytes, ctx: bytes) -> Session:
    """Donor side, on one accepted connection: the peer proves the token, then so do we."""
    mine = os.urandom(NONCE)
    conn.sendall(MAGIC + mine)
    answer = recv_exact(conn, NONCE + PROOF)
    theirs, proof = bytes(answer[:NONCE]), bytes(answer[NONCE:])
    if not hmac.compare_digest(proof, _mac(key, b"joiner", ctx, mine, theirs)):
        raise ChannelError("the peer did not prove the run token")
    conn.sendall(_mac(key, b"donor", ctx, mine, theirs))
    return Session(conn, key, ctx, mine + theirs, donor=True)


def join(sock: socket.socket, key: bytes, ctx: bytes) -> Session:
    """Joiner side, on a connection to the donor: prove the token, check the donor's proof."""
    hello = recv_exact(sock, len(MAGIC) + NONCE)
    if bytes(hello[:len(MAGIC)]) != MAGIC:
        raise ChannelError("not a recover donor")
    donor, mine = bytes(hello[len(MAGIC):]), os.urandom(NONCE)
    sock.sendall(mine + _mac(key, b"joiner", ctx, donor, mine))
    if not hmac.compare_digest(bytes(recv_exact(sock, PROOF)),
                               _mac(key, b"donor", ctx, donor, mine)):
        raise ChannelError("the donor did not prove the run token")
    return Session(sock, key, ctx, donor + mine, donor=False)


def accept(srv: socket.socket, key: bytes, ctx: bytes, timeout_s: float,
           wanted: Callable[[], bool] = lambda: True) -> Session:
    """Donor side: the first connection to `srv` that proves the token, within `timeout_s`.

    A connection that fails the handshake, or says nothing for `HELLO_S`, is closed and the next
    one is accepted; `wanted()` false (the join was given up) or the deadline raises
    `ChannelError`. The session's socket is the caller's to close.
    """
    deadline = Deadline(timeout_s)
    srv.settimeout(POLL_S)
    while True:
        left = deadline.left()
        if left <= 0 or not wanted():
            raise ChannelError("no joiner proved the run token in time" if left <= 0
                               else "the join was given up")
        try:
            conn, peer = srv.accept()
        except TimeoutError:
            continue
        conn.settimeout(min(HELLO_S, max(left, 0.01)))
        try:
            return greet(conn, key, ctx)
        except (OSError, ChannelError) as e:
            log.warning(f"refused a state-transfer connection from {peer[0]}: {e}")
            conn.close()
