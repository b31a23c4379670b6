"""The ZAP decision (``bus/access.py``), the handler's replies (``bus/zap.py``) and
the verified peer on received messages, with a real libzmq handshake."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from inferd.bus.access import AccessPolicy
from inferd.bus.zap import SocketSecurity, ZapHandler, peer_of
from inferd.config import Principal, SecurityConfig, SocketAccess
from inferd.types import Peer
from tests.conftest import HANG_S, wait_until

IPC = {"infer": "ipc", "control": "ipc", "events": "ipc"}
GROUND = bytes(range(32))
DAEMON_UID = 990
OPS_GID = 2000


def groups(uid: int, gid: int) -> frozenset[int]:
    """uid 1002 is in the ops group by the group database; nobody else is."""
    return frozenset({gid, OPS_GID}) if uid == 1002 else frozenset({gid})


def policy(**security: Any) -> AccessPolicy:
    transports = security.pop("transports", IPC)
    return AccessPolicy(
        SecurityConfig(**security),
        transports,
        {GROUND: "ground"},
        daemon_uid=DAEMON_UID,
        groups=groups,
    )


def ipc_address(uid: int, gid: int = 100, pid: int = 4242) -> str:
    return f"localhost:{uid}:{gid}:{pid}"


def unnamed_uid() -> int:
    """A uid no account on this machine has (so its peer's ``user`` is None, whatever
    accounts other tests have created)."""

    def named(uid: int) -> bool:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return False
        return True

    return next(uid for uid in range(61_000, 65_000) if not named(uid))


def test_ipc_peers_get_the_kernels_identity_and_no_rights_by_default() -> None:
    uid = unnamed_uid()
    decision = policy().decide("control", ipc_address(uid, 100, 77), b"NULL", [])
    assert decision.refusal is None
    assert decision.peer == Peer("ipc", uid=uid, gid=100, pid=77, user=None, operator=False)


def test_root_and_the_daemons_user_are_always_operators_and_always_admitted() -> None:
    strict = policy(control=SocketAccess(allow=(Principal("user", 5, "user:5"),)))
    for uid in (0, DAEMON_UID):
        peer = strict.decide("control", ipc_address(uid), b"NULL", []).peer
        assert peer is not None and peer.operator and peer.uid == uid


def test_operators_by_user_and_by_group_membership() -> None:
    operators = (Principal("user", 1001, "user:1001"), Principal("group", OPS_GID, "group:ops"))
    decide = policy(operators=operators).decide
    assert decide("control", ipc_address(1001), b"NULL", []).peer.operator  # type: ignore[union-attr]
    # 1002 is in the ops group through the group database, 1003 by its own gid.
    assert decide("control", ipc_address(1002), b"NULL", []).peer.operator  # type: ignore[union-attr]
    assert decide("control", ipc_address(1003, OPS_GID), b"NULL", []).peer.operator  # type: ignore[union-attr]
    assert not decide("control", ipc_address(1004), b"NULL", []).peer.operator  # type: ignore[union-attr]


def test_an_allow_list_refuses_everyone_else_on_that_socket_only() -> None:
    decide = policy(infer=SocketAccess(allow=(Principal("group", OPS_GID, "group:ops"),))).decide
    refused = decide("infer", ipc_address(1004), b"NULL", [])
    assert refused.peer is None and refused.refusal == "uid 1004 is not in security.infer_allow"
    assert decide("infer", ipc_address(1002), b"NULL", []).peer is not None
    assert decide("control", ipc_address(1004), b"NULL", []).peer is not None


@pytest.mark.parametrize(
    ("domain", "address", "mechanism", "reason"),
    [
        ("infer", "localhost:1:2", b"NULL", "no peer credentials"),
        ("infer", "localhost:a:1:2", b"NULL", "no peer credentials"),
        ("nope", ipc_address(1), b"NULL", "unknown ZAP domain"),
        ("infer", ipc_address(1), b"PLAIN", "mechanism PLAIN is not used"),
    ],
)
def test_what_cannot_be_verified_is_refused(
    domain: str, address: str, mechanism: bytes, reason: str
) -> None:
    decision = policy().decide(domain, address, mechanism, [])
    assert decision.peer is None and reason in (decision.refusal or "")


def test_curve_peers_are_known_keys_and_operators_only_by_key() -> None:
    tcp = {"infer": "tcp", "control": "tcp", "events": "ipc"}
    decide = policy(
        transports=tcp, curve=True, operators=(Principal("key", "ground", "key:ground"),)
    ).decide
    peer = decide("control", "10.0.0.2", b"CURVE", [GROUND]).peer
    assert peer == Peer("tcp", curve_key="ground", address="10.0.0.2", operator=True)
    unknown = decide("control", "10.0.0.2", b"CURVE", [bytes(32)])
    assert unknown.peer is None and "not in security.curve_clients_dir" in (unknown.refusal or "")
    assert decide("control", "10.0.0.2", b"CURVE", [b"short"]).peer is None


def test_tcp_without_curve_is_anonymous_and_never_passes_an_allow_list() -> None:
    tcp = {"infer": "tcp", "control": "tcp", "events": "tcp"}
    peer = policy(transports=tcp).decide("control", "127.0.0.1", b"NULL", []).peer
    assert peer == Peer("tcp", address="127.0.0.1") and not peer.operator
    strict = policy(transports=tcp, infer=SocketAccess(allow=(Principal("user", 0, "user:0"),)))
    assert strict.decide("infer", "127.0.0.1", b"NULL", []).peer is None


def test_the_handler_answers_rfc27_and_carries_the_peer_in_user_id() -> None:
    handler = ZapHandler(zmq.Context.instance(), policy())
    uid = unnamed_uid()
    ok = handler.answer([b"1.0", b"7", b"control", ipc_address(uid).encode(), b"", b"NULL"])
    assert ok[:4] == [b"1.0", b"7", b"200", b"OK"]
    assert Peer(**json.loads(ok[4])) == Peer("ipc", uid=uid, gid=100, pid=4242)
    refused = handler.answer([b"1.0", b"8", b"nope", b"x", b"", b"NULL"])
    assert refused[:3] == [b"1.0", b"8", b"400"] and refused[4] == b""
    assert handler.answer([b"2.0", b"9"])[2] == b"500"
    assert handler.describe() == {"accepted": {"control": 1}, "refused": {"nope": 1}}


HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def _round_trip(
    context: zmq.Context[Any], tmp_path: Path, zap: bool
) -> tuple[zmq.Frame | None, ZapHandler | None]:
    """A DEALER sends one message to a ZAP-protected ROUTER; the server's first
    handshake event (a positive signal either way) says whether it got through."""
    handler = None
    if zap:
        handler = ZapHandler(context, AccessPolicy(SecurityConfig(), IPC, {}))
        handler.start()
        handler.wait_bound(5)
    server = context.socket(zmq.ROUTER)
    monitor = server.get_monitor_socket(HANDSHAKE_EVENTS, addr="inproc://test-access-monitor")
    SocketSecurity().apply("control", server)
    endpoint = f"ipc://{tmp_path}/control.sock"
    server.bind(endpoint)
    client = context.socket(zmq.DEALER)
    client.connect(endpoint)
    client.send(b"hello")
    assert monitor.poll(int(HANG_S * 1000)), "no handshake event"
    event = recv_monitor_message(monitor)["event"]
    frame = None
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        assert server.poll(int(HANG_S * 1000))
        frame = server.recv_multipart(copy=False)[-1]
    else:
        assert not server.poll(0)
    server.disable_monitor()
    for sock in (client, server, monitor):
        sock.close(linger=0)
    if handler is not None:
        handler.stop()
        handler.join(5)
    return frame, handler


def test_a_received_message_carries_the_kernels_credentials(
    context: zmq.Context[Any], tmp_path: Path
) -> None:
    frame, handler = _round_trip(context, tmp_path, zap=True)
    assert frame is not None and handler is not None
    peer = peer_of(frame)
    assert peer is not None and peer.transport == "ipc"
    assert (peer.uid, peer.gid, peer.pid) == (os.geteuid(), os.getegid(), os.getpid())
    assert handler.describe()["accepted"] == {"control": 1}


def test_without_the_zap_handler_no_connection_gets_through(
    context: zmq.Context[Any], tmp_path: Path
) -> None:
    """ZMQ_ZAP_ENFORCE_DOMAIN: fail closed when the handler is not running."""
    frame, _ = _round_trip(context, tmp_path, zap=False)
    assert frame is None


def test_peer_of_a_frame_without_identity_is_none() -> None:
    assert peer_of(zmq.Frame(b"x")) is None
    assert peer_of(None) is None
    assert z85.encode(GROUND)  # the fixture key is a valid 32-byte key


def test_a_local_peer_of_shm_sock_is_decided_as_an_ipc_peer_of_the_infer_socket() -> None:
    listed = policy(infer=SocketAccess(allow=(Principal("group", OPS_GID, "group:ops"),)))
    assert listed.local("infer", 1002, 100, 7).refusal is None  # in ops by the group database
    assert listed.local("infer", 1004, 100, 7).refusal == "uid 1004 is not in security.infer_allow"
    assert listed.names_locally("infer", 1002, 100) and not listed.names_locally("infer", 1004, 100)
    # An empty list admits any local peer, but names none of them but root and the daemon.
    open_policy = policy()
    assert open_policy.local("infer", 1004, 100, 7).refusal is None
    assert not open_policy.names_locally("infer", 1004, 100)
    assert open_policy.names_locally("infer", 0, 0) and open_policy.names_locally(
        "infer", DAEMON_UID, 1
    )


def test_with_infer_on_tcp_shm_sock_admits_only_local_peers_the_allow_list_names(
    tmp_path: Path,
) -> None:
    from inferd.bus.security import BusSecurity
    from tests.unit.config.test_config import MINIMAL, load_text

    def security(text: str) -> BusSecurity:
        return BusSecurity(zmq.Context.instance(), load_text(tmp_path, text + MINIMAL))

    on_tcp = "[bus]\ninfer_endpoint = 'tcp://127.0.0.1:7777'\n"
    me = os.getuid()
    other = unnamed_uid()
    assert security("").local_refusal("infer", other, 100, 7) is None  # ipc: the file decides
    refusal = security(on_tcp).local_refusal("infer", other, 100, 7)
    assert refusal is not None and "security.infer_allow names" in refusal
    assert security(on_tcp).local_refusal("infer", me, os.getgid(), 7) is None  # the daemon's user
    named = on_tcp + f"[security]\ninfer_allow = ['user:{other}']\n"
    assert security(named).local_refusal("infer", other, 100, 7) is None


def test_a_handshake_over_max_connections_is_refused_and_a_new_one_gets_in_later(
    context: zmq.Context[Any], tmp_path: Path
) -> None:
    """``bus.max_connections`` (DESIGN.md 128): with two held by this user, its
    third DEALER's handshake is refused (libzmq does not retry a refused
    handshake); once one of the two closes, a new connection gets in."""
    sockets = SocketSecurity()
    handler = ZapHandler(context, AccessPolicy(SecurityConfig(), IPC, {}), sockets, 2)
    handler.start()
    handler.wait_bound(5)
    server = context.socket(zmq.ROUTER)
    sockets.apply("control", server)
    endpoint = f"ipc://{tmp_path}/control.sock"
    server.bind(endpoint)
    sockets.bound("control", server)
    clients = []

    def connect(text: bytes) -> None:
        client = context.socket(zmq.DEALER)
        client.connect(endpoint)
        client.send(text)
        clients.append(client)

    try:
        for text in (b"first", b"second"):
            connect(text)
            assert server.poll(int(HANG_S * 1000))
            assert server.recv_multipart()[-1] == text
        connect(b"third")
        wait_until(lambda: handler.describe()["refused"] == {"control": 1}, HANG_S)
        wait_until(lambda: handler.connection_counts() == {"control": 2}, HANG_S)
        assert not server.poll(0)  # the third one's message did not get in
        # Counted per peer: this user's two, none of another user's.
        held = sockets.connections["control"]
        assert held.count_from(ipc_address(os.geteuid(), os.getegid(), 1)) == 2
        assert held.count_from(ipc_address(unnamed_uid())) == 0
        clients.pop(0).close(linger=0)
        wait_until(lambda: handler.connection_counts() == {"control": 1}, HANG_S)
        connect(b"fourth")
        assert server.poll(int(HANG_S * 1000))
        assert server.recv_multipart()[-1] == b"fourth"
        assert handler.describe() == {"accepted": {"control": 3}, "refused": {"control": 1}}
    finally:
        for sock in [*clients, server]:
            sock.close(linger=0)
        handler.stop()
        handler.join(5)


def test_a_request_the_handler_fails_on_is_refused_and_the_handler_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception in a decision (a bug) ended the ZAP thread: from then on no
    connection to any of the daemon's sockets was admitted. It is refused (500),
    logged, and the next request is decided as ever."""
    context: zmq.Context[Any] = zmq.Context()
    handler = ZapHandler(context, policy())
    real = handler._policy.decide
    calls: list[int] = []

    def fails_once(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected by the test")
        return real(*args)

    monkeypatch.setattr(handler._policy, "decide", fails_once)
    handler.start()
    handler.wait_bound(5)
    zap = context.socket(zmq.REQ)
    zap.connect("inproc://zeromq.zap.01")
    request = [b"1.0", b"7", b"control", ipc_address(unnamed_uid()).encode(), b"", b"NULL"]
    try:
        with structlog.testing.capture_logs() as logs:
            zap.send_multipart(request)
            assert zap.poll(int(HANG_S * 1000))
            assert zap.recv_multipart()[:3] == [b"1.0", b"7", b"500"]
        assert [line["event"] for line in logs] == ["zap_answer_failed"]
        zap.send_multipart(request)
        assert zap.poll(int(HANG_S * 1000))
        assert zap.recv_multipart()[:3] == [b"1.0", b"7", b"200"]
        assert handler.is_alive()
    finally:
        zap.close(linger=0)
        handler.stop()
        handler.join(5)
        context.term()
