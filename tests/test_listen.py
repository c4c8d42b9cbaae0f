"""Listeners bind exactly the address they are given (control/listen.py, keys.serve_store)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from recover.control import Coordinator, CoordinatorConfig, keys, listen

EVERY = ("0.0.0.0", "::")


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", socket.gethostname()])
def test_listen_binds_one_ipv4_address(host: str) -> None:
    with listen.listen(host, 0) as s:
        assert s.family == socket.AF_INET
        assert s.getsockname()[0] not in EVERY
        assert s.getsockname()[0] == listen.resolve(host, 0)[1][0]


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 on this kernel")
def test_listen_ipv6_is_ipv6_only() -> None:
    with listen.listen("::1", 0) as s:
        assert s.family == socket.AF_INET6
        assert s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        assert s.getsockname()[0] == "::1"


@pytest.mark.parametrize("host", ["no-such-host.invalid", ""])
def test_listen_refuses_in_one_line(host: str) -> None:
    with pytest.raises(listen.ListenError) as e:
        listen.listen(host, 0)
    msg = str(e.value)
    assert msg.startswith(f"cannot listen on {host or repr(host)}:") and "\n" not in msg


def listening(port: int) -> set[str]:
    """The local addresses (hex, as the kernel lists them) listening on TCP `port` (what
    `ss -ltn` shows): all zeros is every interface."""
    addrs = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(path).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                addrs.add(addr)
    return addrs


@pytest.mark.parametrize("host", ["localhost", socket.gethostname()])
def test_serve_store_on_a_name_is_not_on_every_interface(host: str) -> None:
    store = keys.serve_store(host, 0)
    assert store.host not in EVERY and store.host == listen.resolve(host, 0)[1][0]
    ports = listening(store.port)
    assert ports and all(set(a) != {"0"} for a in ports), ports


@pytest.mark.parametrize("host", ["localhost", socket.gethostname()])
def test_a_coordinator_on_a_name_listens_nowhere_else(host: str, tmp_path: Path) -> None:
    """`recover coordinator --host NAME`: its store, liveness listener and store shards each
    listen on the one address NAME resolves to, none on `*` / 0.0.0.0."""
    coord = Coordinator(CoordinatorConfig(replicas=1, host=host, port=0, store_shards=2,
                                          log_path=str(tmp_path / "c.jsonl")))
    coord.start()
    ports = [coord.store.port, coord.liveness_port, *(s.port for s in coord.shards)]
    for port in ports:
        addrs = listening(int(port))
        assert addrs and all(set(a) != {"0"} for a in addrs), (port, addrs)
