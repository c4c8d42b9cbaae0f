"""Which local address reaches where: interface addresses and the kernel's route (Linux).

Invariant: each function only asks the kernel (an ioctl, a UDP connect that sends nothing) and
returns None instead of raising when it cannot tell; nothing here resolves a name.
"""

from __future__ import annotations

import ipaddress
import socket


def iface_addr(name: str) -> str | None:
    """The IPv4 address of interface `name` (Linux SIOCGIFADDR), or None."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(raw[20:24])
    except (ImportError, OSError):
        return None


def iface_of(addr: str) -> str | None:
    """The name of the interface holding IPv4 address `addr`, or None."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if iface_addr(n) == addr), None)


def source_towards(peer: str) -> str | None:
    """The local address the kernel routes traffic to `peer` from (a UDP connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in peer else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def is_loopback(addr: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (and IPv4-mapped forms); False for names and other addresses."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
