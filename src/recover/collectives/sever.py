"""Ending a gloo operation that waits on a hung peer, from this side.

Invariant: `sever(socks)` shuts down only the connected sockets a gloo group opened while it was
built here (identified by fd *and* socket inode, so an fd number reused since then is never
touched), never a listener (gloo aborts the process when its listener fails) and never a socket to
a port in `spare` (the store's and the coordinator's, which other threads may connect to while a
group is built).

Why: gloo cannot abort an operation in flight (`abort()`/`shutdown()` do not unblock it, DESIGN
§5), so an operation stuck on a peer whose process hangs with its sockets open kept its buffers,
and its group's destructor blocked, until gloo's own timeout. Shutting the group's sockets down
makes gloo fail the operation at once ("connection closed", measured ~5 ms on loopback), after
which its buffers are free and destroying the group is cheap. The peers' side of each connection
fails too, which is what they need: the operation belongs to a generation nobody can commit in.
Linux only (/proc/self/fd); elsewhere nothing is tracked and the caller holds the buffers.
"""

from __future__ import annotations

import os
import socket

Sock = tuple[int, str]  # (fd, "socket:[inode]")


def sockets() -> dict[int, str]:
    """This process's socket fds and their inodes."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def opened_since(before: dict[int, str], spare: set[int]) -> list[Sock]:
    """The connected sockets opened since `before`, less those whose peer's port is `spare`."""
    out: list[Sock] = []
    for fd, inode in sockets().items():
        if before.get(fd) == inode:
            continue
        peer = _peer(fd)
        if peer is not None and peer[1] not in spare:
            out.append((fd, inode))
    return out


def sever(socks: list[Sock]) -> int:
    """Shut down each socket still open under the same inode; returns how many were."""
    n = 0
    for fd, inode in socks:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != inode:
                continue  # closed by gloo, and the number reused: not ours any more
            dup = os.dup(fd)
        except OSError:
            continue
        s = socket.socket(fileno=dup)
        try:
            s.shutdown(socket.SHUT_RDWR)  # acts on the socket, whichever fd refers to it
            n += 1
        except OSError:
            pass
        finally:
            s.close()  # closes our duplicate only; gloo closes its own fd
    return n


def _peer(fd: int) -> tuple[str, int] | None:
    """The (address, port) `fd` is connected to; None for a listener or a non-TCP socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    s = socket.socket(fileno=dup)
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        peer = s.getpeername()
        return str(peer[0]), int(peer[1])
    except OSError:
        return None  # not connected: a listener
    finally:
        s.close()
