"""What every client socket does before it connects: the rules of
``inferd_wire.endpoints.check_client_endpoint``, raised as client errors, and
CURVE where the endpoint is ``tcp://``."""

from __future__ import annotations

from typing import Any

import zmq

from inferd_client.errors import InvalidArgument, UnsafeEndpoint
from inferd_wire.curve import ClientCurve
from inferd_wire.endpoints import EndpointError, UnsafeEndpointError, check_client_endpoint


def trusted_endpoint(endpoint: str) -> str:
    """``endpoint``; ``UnsafeEndpoint`` when it is a socket in a directory another
    user could write, ``InvalidArgument`` when no socket can have its address."""
    try:
        return check_client_endpoint(endpoint)
    except UnsafeEndpointError as exc:
        raise UnsafeEndpoint(str(exc)) from None
    except EndpointError as exc:
        raise InvalidArgument(str(exc)) from None


def connect(sock: zmq.Socket[Any], endpoint: str) -> None:
    """``sock.connect(endpoint)``; ``InvalidArgument`` naming the endpoint when ZeroMQ
    cannot parse it (``tcp://host`` without a port): the caller closes ``sock``."""
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise InvalidArgument(f"cannot connect to {endpoint!r}: {exc}") from None


def secure(sock: zmq.Socket[Any], endpoint: str, curve: ClientCurve | None) -> None:
    """CURVE on ``sock`` before it connects; only a tcp:// endpoint uses it."""
    if curve is None:
        return
    if not endpoint.startswith("tcp://"):
        raise InvalidArgument(
            f"CURVE is for tcp:// endpoints; {endpoint} is reached through the file system's "
            "permissions and the daemon's check of the connecting user"
        )
    curve.apply(sock)
