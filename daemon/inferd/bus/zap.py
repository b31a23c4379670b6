"""The daemon's ZAP handler (ZeroMQ RFC 27): every connection to the infer,
control and events sockets is authenticated here, at its handshake, before any
message of it is read.

Each socket gets its name as ZAP domain and ``ZMQ_ZAP_ENFORCE_DOMAIN``, so a
connection is refused when this handler is not running (fail closed).  For an
admitted connection the reply's User-Id carries the verified ``Peer`` as JSON;
libzmq attaches it to every message of that connection as the ``User-Id``
property, which ``peer_of`` reads: the request never gets to say who it is.
An admitted handshake is refused all the same while its peer (a local user, a
remote address: an IPv6 one's /64, ``tcp_peer_key``) holds more than
``bus.max_connections`` connections to the socket (``EndpointConnections.count_from``,
this one included), and a connection must finish its handshake within
``HANDSHAKE_TIMEOUT_MS``: what one peer can make a socket hold is bounded
(DESIGN.md 128).

The handler is a thread with a REP socket on ``inproc://zeromq.zap.01`` of the
daemon's context (only one handler can bind it).  pyzmq's ``ThreadAuthenticator``
is not used: it matches addresses as strings, cannot check a uid or group, and
logs instead of failing when its key directory is missing (DESIGN.md 61).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from inferd.bus.access import AccessPolicy
from inferd.bus.binding import BindOutcome
from inferd.bus.endpoint_connections import EndpointConnections
from inferd.types import Peer, tcp_peer_key

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: ``ZMQ_HANDSHAKE_IVL`` of every bound socket: a connection that has not
#: finished its handshake by then is closed (libzmq's default is 30 s; a client
#: on this machine or its link needs milliseconds, CURVE included).
HANDSHAKE_TIMEOUT_MS = 5000
_VERSION = b"1.0"
_POLL_MS = 100

log = structlog.get_logger("inferd.zap")


@dataclass(frozen=True)
class ServerKeys:
    """The daemon's CURVE keypair (Z85), for its tcp:// sockets."""

    public: str
    secret: str


@dataclass
class SocketSecurity:
    """How each socket is protected: ZAP always, CURVE on tcp:// when configured."""

    curve: ServerKeys | None = None
    tcp_sockets: frozenset[str] = frozenset()
    #: Each bound socket's connections, by name (``bound``), for the ZAP handler.
    connections: dict[str, EndpointConnections] = field(default_factory=dict)

    def apply(self, name: str, sock: zmq.Socket[Any]) -> None:
        """Before ``sock`` (the socket ``name``) binds."""
        sock.setsockopt(zmq.ZAP_DOMAIN, name.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        if self.curve is not None and name in self.tcp_sockets:
            sock.curve_secretkey = self.curve.secret.encode()
            sock.curve_publickey = self.curve.public.encode()
            sock.curve_server = True

    def bound(self, name: str, sock: zmq.Socket[Any]) -> None:
        """After ``sock`` (the socket ``name``) bound: its connections are counted at
        the endpoint it got (a ``tcp://`` port chosen at the bind included)."""
        self.connections[name] = EndpointConnections(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def mechanism(self, name: str) -> str:
        return "CURVE" if self.curve is not None and name in self.tcp_sockets else "NULL"


def peer_of(frame: Any) -> Peer | None:
    """The verified peer of a received message (a ``zmq.Frame``), or None when its
    connection was not authenticated by this handler."""
    try:
        text = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return _peer_from(text)


@functools.lru_cache(maxsize=256)
def _peer_from(text: str) -> Peer | None:
    # Every message of a connection carries the same User-Id text: parsed once
    # per peer, not per request (a Peer is frozen, so sharing it is safe).
    try:
        fields = json.loads(text)
        return Peer(**fields)
    except (ValueError, TypeError):
        return None


@dataclass
class ZapCounters:
    accepted: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)


class ZapHandler(threading.Thread):
    def __init__(
        self,
        context: zmq.Context[Any],
        policy: AccessPolicy,
        sockets: SocketSecurity | None = None,
        max_connections: int = 0,
    ) -> None:
        """``sockets``' connections are held to ``max_connections`` each (0: no
        bound, for a handler that only decides who may connect)."""
        super().__init__(name="inferd-zap", daemon=True)
        self._context = context
        self._policy = policy
        self._sockets = sockets or SocketSecurity()
        self._max_connections = max_connections
        self._stop_requested = threading.Event()
        self._bind_outcome = BindOutcome("the ZAP handler")
        self.counters = ZapCounters()

    def wait_bound(self, timeout: float) -> None:
        self._bind_outcome.wait(timeout)

    def stop(self) -> None:
        self._stop_requested.set()

    def run(self) -> None:
        sock: zmq.Socket[Any] = self._context.socket(zmq.REP)
        try:
            sock.bind(ZAP_ENDPOINT)
        except BaseException as exc:
            self._bind_outcome.failed(exc)
            sock.close(linger=0)
            return
        self._bind_outcome.bound()
        try:
            while not self._stop_requested.is_set():
                if sock.poll(_POLL_MS, zmq.POLLIN):
                    sock.send_multipart(self._answer_or_refuse(sock.recv_multipart()))
        finally:
            sock.close(linger=0)

    def _answer_or_refuse(self, request: list[bytes]) -> list[bytes]:
        """``answer``, or a refusal when it raises (a bug): the thread must go on,
        since without it no connection to any socket is admitted."""
        try:
            return self.answer(request)
        except Exception:
            log.exception("zap_answer_failed")
            request_id = request[1] if len(request) > 1 else b""
            return [_VERSION, request_id, b"500", b"internal error", b"", b""]

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request (RFC 27): 200 with the peer as User-Id, or 400."""
        if len(request) < 6 or request[0] != _VERSION:
            request_id = request[1] if len(request) > 1 else b""
            log.error("zap_request_malformed", frames=len(request))
            return [_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""]
        _version, request_id, domain, address, _identity, mechanism = request[:6]
        socket = domain.decode(errors="replace")
        decision = self._policy.decide(
            socket, address.decode(errors="replace"), mechanism, request[6:]
        )
        if decision.peer is None:
            refusal: str | None = decision.refusal or "refused"
        else:
            # A CURVE peer is counted by its own address: the connections other
            # addresses of its /64 hold (an anonymous flood) never count against it.
            exact = decision.peer.curve_key is not None
            refusal = self._over_bound(socket, address.decode(errors="replace"), exact=exact)
        if refusal is not None:
            self._count(self.counters.refused, socket)
            log.warning(
                "peer_refused",
                socket=socket,
                address=address.decode(errors="replace"),
                mechanism=mechanism.decode(errors="replace"),
                reason=refusal,
            )
            reason = refusal.encode()
            return [_VERSION, request_id, b"400", reason, b"", b""]
        assert decision.peer is not None  # refused above otherwise
        self._count(self.counters.accepted, socket)
        log.debug("peer_admitted", socket=socket, **decision.peer.as_record())
        user_id = json.dumps(decision.peer.as_record(), separators=(",", ":")).encode()
        return [_VERSION, request_id, b"200", b"OK", user_id, b""]

    def _over_bound(self, socket: str, address: str, *, exact: bool = False) -> str | None:
        """Why the peer at ``address`` may hold no more connections to ``socket``
        (None: it may).  Counted per peer (a local user, a remote address: an IPv6
        one's /64, whose 2**64 addresses are one host's), so one peer's connections,
        handshaking ones included, never keep out another's."""
        connections = self._sockets.connections.get(socket)
        if not self._max_connections or connections is None:
            return None
        held = connections.count_from(address, exact=exact)  # this connection's own included
        if held <= self._max_connections:
            return None
        key = tcp_peer_key(address) if connections.tcp_port is not None and not exact else address
        who = "this peer" if key == address else f"this peer (counted as {key})"
        return (
            f"{who} holds {held} connections to the {socket} socket, over "
            f"bus.max_connections ({self._max_connections}); close one and reconnect"
        )

    def connection_counts(self) -> dict[str, int]:
        """The connections each bound socket holds now."""
        return {name: found.count() for name, found in self._sockets.connections.items()}

    @staticmethod
    def _count(counts: dict[str, int], socket: str) -> None:
        counts[socket] = counts.get(socket, 0) + 1

    def describe(self) -> Mapping[str, Any]:
        return {"accepted": dict(self.counters.accepted), "refused": dict(self.counters.refused)}
