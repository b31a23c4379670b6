"""A tcp peer's accounting key (``types.tcp_peer_key``): an IPv6 peer is its /64, an
IPv4-mapped address its IPv4 one, so one host owning a /64 is one peer for
``bus.max_connections`` (the ZAP handler), the descriptor guard's bound and fair
shares, and the per-peer rate limits (``Peer.key``)."""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import example, given
from hypothesis import strategies as st

from inferd.bus.access import AccessPolicy
from inferd.bus.descriptor_scan import _Pass, end_extra_connections
from inferd.bus.endpoint_connections import EndpointConnections
from inferd.bus.zap import SocketSecurity, ZapHandler
from inferd.config import SecurityConfig
from inferd.peer_rate_limit import PeerRateLimiter
from inferd.types import Peer, tcp_peer_key
from tests.conftest import HANG_S
from tests.unit.bus import ipv6_namespace

REPO = Path(__file__).resolve().parents[3]
TCP = {"infer": "tcp", "control": "tcp", "events": "tcp"}


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("10.1.2.3", "10.1.2.3"),
        ("::ffff:127.0.0.2", "127.0.0.2"),  # a dual-stack socket's IPv4 peer
        ("2001:db8:1:2::5", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("2001:db8::1", "2001:db8::/64"),
        ("fe80::5%eth0", "fe80::/64"),  # the zone libzmq and getpeername add
        ("::1", "::/64"),
        ("not an address", "not an address"),
    ],
)
def test_a_tcp_peers_key_is_its_ipv4_address_or_its_ipv6_64(address: str, key: str) -> None:
    assert tcp_peer_key(address) == key
    if key != address and not address.startswith("fe80"):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        assert tcp_peer_key(socket.inet_pton(family, address)) == key  # a sockaddr's bytes


@given(st.integers(min_value=0, max_value=2**128 - 1))
@example(1 << 64)  # 0:0:0:1::/64, zeros on both sides of the prefix's last word
@example(0xFFFF << 32)  # ::ffff:0.0.0.0, the first mapped address
def test_the_key_of_any_ipv6_address_is_its_canonical_64_or_its_mapped_ipv4(value: int) -> None:
    address = ipaddress.IPv6Address(value)
    expected = (
        str(address.ipv4_mapped)
        if address.ipv4_mapped is not None
        else str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    )
    assert tcp_peer_key(str(address)) == expected
    assert tcp_peer_key(address.packed) == expected


def test_two_addresses_of_one_64_are_one_rate_limited_peer_another_64_is_not() -> None:
    """``Peer.key`` of anonymous tcp peers: one /64 is one principal, a mapped IPv4
    address is the IPv4 one; CURVE peers stay their key, local ones their uid."""
    first = Peer("tcp", address="2001:db8:1:2::1")
    same = Peer("tcp", address="2001:db8:1:2:aaaa::2")
    other = Peer("tcp", address="2001:db8:1:3::1")
    assert first.key == same.key == "tcp:2001:db8:1:2::/64"
    assert other.key == "tcp:2001:db8:1:3::/64"
    assert Peer("tcp", address="::ffff:127.0.0.2").key == Peer("tcp", address="127.0.0.2").key
    assert Peer("tcp", curve_key="ground", address="2001:db8:1:2::1").key == "key:ground"
    assert Peer("ipc", uid=1001, gid=100, pid=7).key == "uid:1001"
    # Messages and records keep the real address; a message adds what it counts as.
    assert same.describe() == (
        "an unauthenticated tcp peer at 2001:db8:1:2:aaaa::2 (counted as 2001:db8:1:2::/64)"
    )
    assert Peer("tcp", address="127.0.0.2").describe() == "an unauthenticated tcp peer at 127.0.0.2"
    assert same.as_record()["address"] == "2001:db8:1:2:aaaa::2"

    now = [0.0]
    limiter = PeerRateLimiter("build.start", 1, 60.0, "builds.start_*", clock=lambda: now[0])
    assert limiter.retry_after(first.key) is None
    limiter.take(first.key)
    wait_s = limiter.retry_after(same.key)
    assert wait_s is not None  # the other address of the /64 has no bucket of its own
    assert "counted as 2001:db8:1:2::/64" in str(limiter.refusal(same, wait_s))
    assert limiter.retry_after(other.key) is None


@pytest.fixture
def ipv6_listener() -> Iterator[socket.socket]:
    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    listener.bind(("::1", 0))
    listener.listen(16)
    yield listener
    listener.close()


def _connect(stack: ExitStack, listener: socket.socket, source: str = "") -> socket.socket:
    client = socket.socket(listener.family, socket.SOCK_STREAM)
    stack.callback(client.close)
    if source:
        client.bind((source, 0))
    client.connect(listener.getsockname()[:2])
    stack.callback(listener.accept()[0].close)
    return client


def test_zap_counts_every_address_of_a_64_against_one_bound(
    ipv6_listener: socket.socket,
) -> None:
    """The real handler and ``EndpointConnections`` over real connections: two from
    ``::1`` held, ``bus.max_connections`` 1; a handshake from ``::2`` (an address of
    the same /64; this host's lo has only ``::1``, so its own connection is not
    among them) is refused with the two counted, one from another /64 is not."""
    sockets = SocketSecurity()
    port = ipv6_listener.getsockname()[1]
    sockets.connections["control"] = EndpointConnections(f"tcp://[::1]:{port}")
    handler = ZapHandler(
        zmq.Context.instance(), AccessPolicy(SecurityConfig(), TCP, {}), sockets, 1
    )

    def answer(address: str) -> list[bytes]:
        return handler.answer([b"1.0", b"1", b"control", address.encode(), b"", b"NULL"])

    with ExitStack() as stack:
        for _ in range(2):
            _connect(stack, ipv6_listener)
        assert sockets.connections["control"].count_from("::2") == 2
        refused = answer("::2")
        assert refused[2:4] == [
            b"400",
            b"this peer (counted as ::/64) holds 2 connections to the control socket, over "
            b"bus.max_connections (1); close one and reconnect",
        ]
        assert answer("2001:db8::1")[2] == b"200"
        assert handler.describe() == {"accepted": {"control": 1}, "refused": {"control": 1}}


def test_the_guard_counts_a_dual_stack_sockets_ipv4_peer_as_its_ipv4_address() -> None:
    """A dual-stack socket's IPv4 peer, which ``getpeername`` gives as
    ``::ffff:127.0.0.2``, is the peer ``127.0.0.2`` to the pass (as to ZAP and
    ``Peer.key``), and ``holds`` re-checks it by that key."""
    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    with ExitStack() as stack:
        stack.callback(listener.close)
        listener.bind(("::ffff:127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        sockets = {"t": EndpointConnections(f"tcp://127.0.0.1:{port}")}
        clients = []
        for _ in range(3):
            client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            stack.callback(client.close)
            client.bind(("127.0.0.2", 0))
            client.connect(("127.0.0.1", port))
            accepted, peer = listener.accept()
            stack.callback(accepted.close)
            assert peer[0] == "::ffff:127.0.0.2"
            clients.append(accepted)
        scan = _Pass(sockets)
        assert scan.holds(clients[0].fileno(), ("t", "127.0.0.2"))
        assert not scan.holds(clients[0].fileno(), ("t", "::ffff:127.0.0.2"))
        assert sockets["t"].count_from("127.0.0.2") == 3
        assert sockets["t"].count_from("::ffff:127.0.0.2") == 3
        assert end_extra_connections(sockets, 2).past_bound == Counter({("t", "127.0.0.2"): 1})


def _namespace_or_skip() -> None:
    """Skip where no network namespace of one's own can be made (no ``unshare``
    or ``ip``, user namespaces off)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare(1) and ip(8)")
    probe = subprocess.run(
        ["unshare", "-rn", "true"], capture_output=True, text=True, timeout=HANG_S
    )
    if probe.returncode != 0:
        pytest.skip(f"no network namespace here: {probe.stderr.strip()}")


def test_in_a_namespace_of_its_own_two_addresses_of_a_64_are_one_peer_on_real_sockets() -> None:
    """Real connections from 2001:db8:1:2::2 and ::3 (one /64, added to ``lo`` of a
    network namespace of the test's own, so the host's is untouched) and from
    2001:db8:1:3::2 (another): the guard's pass keeps 2 of the /64's three (not
    2 of each address's), holds them to a share as one peer, and ``holds``
    re-checks by the /64; the ZAP handler, at one connection a peer, refuses ::3
    after ::2 and admits the other /64."""
    _namespace_or_skip()
    setup = " && ".join(
        ["ip link set lo up"]
        + [f"ip -6 addr add {address}/64 dev lo nodad" for address in ipv6_namespace.ADDRESSES]
    )
    script = f'{setup} || exit 77; exec "$0" -m tests.unit.bus.ipv6_namespace'
    done = subprocess.run(
        ["unshare", "-rn", "sh", "-c", script, sys.executable],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=4 * HANG_S,
    )
    if done.returncode == 77:
        pytest.skip(f"no IPv6 addresses on a namespace's lo: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)

    guard = found["guard"]
    assert guard["holds"] == {
        "2001:db8:1:2::/64": True,
        "2001:db8:1:3::/64": False,
        "2001:db8:1:2::3": False,  # the address is not the key
    }
    assert guard["past_bound"] == [["t", "2001:db8:1:2::/64", 1]]
    assert guard["ended_past_bound"] == [2]  # the /64's third, in descriptor order
    # What is left, the /64's 2 and the other's 1, held to 2: one each.
    assert (guard["past_share"], guard["share"]) == ([["t", "2001:db8:1:2::/64", 1]], 1)

    zap = found["zap"]
    assert zap["counters"] == {"accepted": {"control": 2}, "refused": {"control": 1}}
    assert [text for text, *_ in zap["received"]] == ["first", "third"]
    assert zap["received"][0][1:3] == ["2001:db8:1:2::2", "tcp:2001:db8:1:2::/64"]
    assert zap["received"][1][1:3] == ["2001:db8:1:3::2", "tcp:2001:db8:1:3::/64"]
    assert zap["refusals"] == [
        "this peer (counted as 2001:db8:1:2::/64) holds 2 connections to the control "
        "socket, over bus.max_connections (1); close one and reconnect"
    ]
