"""Ending a gloo operation that waits on a hung peer, from this side.

Invariant: `sever(socks)` shuts down only the connected sockets a gloo group opened while it was
built here, never a listener (gloo aborts the process when its listener fails) and never a socket
to a port in `spare` (the store's and the coordinator's, which other threads may connect to while
a group is built). It acts on the sockets themselves: `opened_since` keeps a duplicate descriptor
of each, so a number gloo closed and the process reused is never touched; `release` closes the
duplicates (the connections then close when gloo closes its own descriptors).

Why: gloo cannot abort an operation in flight (`abort()`/`shutdown()` do not unblock it:
docs/MEASUREMENTS.md, "gloo on CPU"), so an operation stuck on a peer whose process hangs with its
sockets open keeps its buffers, and its group's destructor blocks, until gloo's own timeout.
Shutting the group's sockets down makes gloo fail the operation at once ("connection closed",
within milliseconds on loopback), after which its buffers are free and destroying the group is
cheap; which side to shut is `sever`'s `how` (docs/MEASUREMENTS.md, "Severing a gloo
operation"). The peers' side fails too once we shut ours for writing, which is what they need:
the operation belongs to a generation nobody can commit in.
Holding the duplicates makes a sever one system call per socket: every survivor of a failure severs
its R - 1 connections at once, so at a large R a readlink + dup + close per socket would show in
the survivors' agreement time (docs/MEASUREMENTS.md, "Severing a gloo operation").
Linux only (/proc/self/fd); elsewhere nothing is tracked and the caller holds the buffers.
"""

from __future__ import annotations

import os
import socket


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


def opened_since(before: dict[int, str], spare: set[int]) -> list[socket.socket]:
    """Duplicates of the connected TCP sockets opened since `before`, less those with an end on
    a port in `spare` (a client of the store, or the store's own side of one where the
    coordinator shares the process). The caller owns them: `release` them when the group is let
    go."""
    out: list[socket.socket] = []
    for fd, inode in sockets().items():
        if before.get(fd) == inode:
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        try:
            keep = (s.family in (socket.AF_INET, socket.AF_INET6)
                    and s.type == socket.SOCK_STREAM and s.getpeername()[1] not in spare
                    and s.getsockname()[1] not in spare)
        except OSError:
            keep = False  # not connected: a listener
        if keep:
            out.append(s)
        else:
            s.close()
    return out


def sever(socks: list[socket.socket], how: int = socket.SHUT_RDWR) -> int:
    """Shut down each socket (whichever descriptor refers to it); returns how many were open.

    `how`: with an operation of ours in flight, the reading side alone (`SHUT_RD`): gloo's loop
    reads end-of-file on every pair and fails the operation. A shut writing side makes a send the
    operation still issues fail with `EPIPE`, which gloo's asynchronous write takes for "try again
    later" and queues; a queued send of an unbound buffer (ring all-reduce's) is not failed by the
    pair's error, so the operation waits in `waitSend` until the group's timeout. Once both sides
    are shut, data a peer still sends is answered with a reset, and the peer's send can be lost the
    same way. With nothing of ours in flight, the writing side alone (`SHUT_WR`): the peers read
    end-of-file, and their sends still land. (Measured, docs/MEASUREMENTS.md, "Severing a gloo
    operation": cuts of in-flight all-reduces hang with `SHUT_RDWR`, not with `SHUT_RD`.)
    """
    n = 0
    for s in socks:
        try:
            s.shutdown(how)
            n += 1
        except OSError:
            pass  # already closed by the peer or shut down before
    return n


def release(socks: list[socket.socket]) -> None:
    """Close the duplicates (gloo's own descriptors are gloo's)."""
    for s in socks:
        s.close()
