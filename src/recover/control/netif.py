"""Which local address cross-replica gloo traffic binds, and what the kernel says reaches where.

Invariants:
- The address is the interface the user names (`--gloo-ifname`, which sets $GLOO_SOCKET_IFNAME,
  torch's own variable), else this host's end of its connection to the coordinator; never the
  hostname's resolution, which is loopback on many hosts.
- Loopback is never used when another member is on another host: an automatic choice moves to the
  kernel's route towards that member; a named interface raises `GlooInterfaceError` (one line:
  the interface and the fix) at the first build.
- The kernel helpers (`iface_addr`, `iface_of`, `source_towards`, `is_loopback`) only ask the
  kernel (an ioctl, a UDP connect that sends nothing) and return None instead of raising when
  they cannot tell; nothing here resolves a name.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket

from recover.errors import RecoverError

log = logging.getLogger(__name__)

IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # torch's own variable; `--gloo-ifname` sets it for a worker
_HINTED: list[bool] = []  # a connect-failure hint was logged by this process (once is enough)


class GlooInterfaceError(RecoverError, RuntimeError):
    """Cross-replica traffic would bind an interface the other replicas cannot reach."""


class GlooInterface:
    """The address one process's cross-replica gloo traffic binds (see the module docstring).

    `ifname`: the interface(s) the user names (comma-separated), else $GLOO_SOCKET_IFNAME, else
    none (the automatic choice). The address is resolved once, at the first build (`bind`).
    """

    def __init__(self, replica: int, ifname: str | None = None) -> None:
        self.replica = replica
        self.ifname = ifname or os.environ.get(IFNAME_ENV) or None
        self.addr: str | None = None  # resolved by the first `bind`; "" for gloo's default

    def bind(self, local_addr: str, coordinator: str, coordinator_remote: bool) -> str | None:
        """The local address to bind (None: gloo's default, or unknown). `local_addr`: this
        host's end of its connection to `coordinator` (a host), which is remote or not."""
        if self.addr is None:
            if self.ifname:
                for name in self.ifname.split(","):
                    try:
                        socket.if_nametoindex(name)
                    except OSError:
                        raise GlooInterfaceError(
                            f"replica {self.replica}: no network interface named {name!r} on "
                            f"this host (--gloo-ifname / {IFNAME_ENV}); `ip addr` lists them"
                        ) from None
                self.addr = iface_addr(self.ifname.split(",")[0]) or ""
            else:
                self.addr = local_addr
            if self.addr and is_loopback(self.addr) and coordinator_remote:
                # Only a named interface gets here: the automatic choice is the local end of a
                # connection to a remote coordinator, which is never loopback.
                raise GlooInterfaceError(
                    f"replica {self.replica}: cross-replica traffic would use "
                    f"{self.where(self.addr)}, a loopback interface, but the coordinator at "
                    f"{coordinator} is remote; set --gloo-ifname (or {IFNAME_ENV}) to the "
                    "interface that reaches the other replicas' hosts, or leave it unset")
        return self.addr or None

    def off_loopback(self, addr: str, others: list[str] | None) -> str:
        """Keep the loopback `addr` only if every other member of the group (`others`: the
        addresses they published; None: one published none) is on this host too."""
        if others is None:
            return addr  # a member that publishes no address: nothing to compare with
        remote = [a for a in others if not is_loopback(a)]
        if not remote:
            return addr  # everyone on this host: loopback is right
        if self.ifname:
            raise GlooInterfaceError(
                f"replica {self.replica}: cross-replica traffic would use {self.where(addr)}, a "
                f"loopback interface, but other members are on other hosts ({remote[0]}); set "
                f"--gloo-ifname (or {IFNAME_ENV}) to the interface that reaches them")
        # This host reaches the coordinator over loopback (it runs the coordinator, or its name
        # resolves to 127.0.1.1) while others are elsewhere: bind the route towards them.
        routed = source_towards(remote[0])
        if routed is None or is_loopback(routed):
            raise GlooInterfaceError(
                f"replica {self.replica}: reaches the coordinator over loopback ({addr}) and "
                f"finds no route to the other members ({remote[0]}); set --gloo-ifname (or "
                f"{IFNAME_ENV}) to the interface that reaches them")
        self.addr = routed
        log.warning("replica %d: the coordinator is reached over loopback (%s) but other members "
                    "are remote: cross-replica traffic uses %s (--gloo-ifname overrides)",
                    self.replica, addr, self.where(routed))
        return routed

    def where(self, addr: str | None) -> str:
        """`addr (interface)` for messages."""
        name = self.ifname or (iface_of(addr) if addr else None)
        return f"{addr} ({name})" if name and addr else (addr or name or "gloo's default")

    def hint(self, why: str, addr: str | None) -> None:
        """One line per process when a build cannot connect: the usual cause is the interface."""
        if "connect" not in why.lower() or _HINTED:
            return
        _HINTED.append(True)
        log.warning("replica %d: the cross-replica communicator could not connect from %s: %s. "
                    "If every build fails, the other replicas cannot reach this interface: set "
                    "--gloo-ifname (or %s) to the one on their network", self.replica,
                    self.where(addr), why, IFNAME_ENV)


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


_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LOOPBACK_V4 = re.compile(rf"127\.{_OCTET}\.{_OCTET}\.{_OCTET}")


def is_loopback(addr: str) -> bool:
    """True for 127.0.0.0/8 and ::1 (and IPv4-mapped forms); False for names and other addresses."""
    if _LOOPBACK_V4.fullmatch(addr):
        return True  # the common case without ipaddress's parse (a build reads R - 1 addresses)
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
