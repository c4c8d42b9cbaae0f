"""Listening sockets bound to exactly the address they are given: every listener of recover's.

Invariant: `listen(host, port)` returns a socket that listens on the one address `host` names, or
raises `ListenError` (one line: `cannot listen on <host>: <reason>`); it never falls back to
another address, least of all to every interface.

- A literal IPv4 address: an AF_INET socket on it (`0.0.0.0`: every IPv4 interface).
- A literal IPv6 address: an AF_INET6 socket with IPV6_V6ONLY, so `::1` takes no IPv4 traffic and
  `::` is every IPv6 interface, not both families' (a scoped `fe80::1%eth0` keeps its scope).
- A name (`localhost`, the hostname): resolved by getaddrinfo (/etc/hosts answers these two
  without the network), and the first IPv4 address it resolves to is bound, else the first IPv6
  one. IPv4 first because the store server resolves every new peer's name on its one thread, and
  /etc/hosts answers the IPv4 loopback and the hostname's IPv4 address but often not ::1: an
  IPv6 listener risks the resolver's 5 s stalls
  (docs/MEASUREMENTS.md, "TCPStore"). A name that resolves to several addresses gets one listener,
  on one of them: a client that tries another first is refused there and goes on to the next.
- An empty host is refused: every interface is bound only when asked for by name (`0.0.0.0`,
  `::`), never by omission.
"""

from __future__ import annotations

import socket

from recover.errors import RecoverError

# The unspecified addresses: a listener there is reached through every interface of its family.
EVERY_INTERFACE = ("0.0.0.0", "::")


class ListenError(RecoverError, OSError):
    """A listener could not be made on the address asked for; the message is one line."""


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on exactly `host` (see the module docstring), port `port` (0: any).

    SO_REUSEADDR as torch's and Python's own listeners set it (a restarted coordinator rebinds its
    fixed ports while the old connections are in TIME_WAIT)."""
    family, sockaddr = resolve(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        where = f"{sockaddr[0]} port {port}" if sockaddr[0] != host else f"port {port}"
        raise ListenError(f"cannot listen on {host}: {where}: {e.strerror or e}") from None
    return sock


def resolve(host: str, port: int) -> tuple[int, tuple]:
    """(family, sockaddr) that `listen` binds for `host`; ListenError when there is none."""
    if not host:
        raise ListenError("cannot listen on '': no address given (0.0.0.0 or :: for every "
                          "interface)")
    try:  # a literal address: no lookup at all
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                   flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        try:
            infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ListenError(f"cannot listen on {host}: the name does not resolve "
                              f"({getattr(e, 'strerror', None) or e})") from None
    except (UnicodeError, ValueError) as e:
        raise ListenError(f"cannot listen on {host!r}: not an address or a name ({e})") from None
    usable = [(f, a) for f, _, _, _, a in infos if f in (socket.AF_INET, socket.AF_INET6)]
    if not usable:
        raise ListenError(f"cannot listen on {host}: it resolves to no IPv4 or IPv6 address")
    v4 = [u for u in usable if u[0] == socket.AF_INET]
    return (v4 or usable)[0]


def bound_host(sock: socket.socket) -> str:
    """The address `sock` listens on, numeric, for a client of this process to connect to: the
    loopback of its family when it listens on every interface."""
    addr = sock.getsockname()[0]
    if addr in EVERY_INTERFACE:
        return "127.0.0.1" if sock.family == socket.AF_INET else "::1"
    return addr
