"""What every client socket does before it connects: the rules of
``inferd_wire.endpoints.check_client_endpoint``, raised as client errors, and
CURVE where the endpoint is ``tcp://``; and after: it is used only in the process
that made it (``check_process``)."""

from __future__ import annotations

import os
from typing import Any

import zmq

from inferd_client.errors import ClientError, InvalidArgument, Unreachable, UnsafeEndpoint
from inferd_wire.curve import ClientCurve
from inferd_wire.endpoints import (
    EndpointError,
    UncheckedEndpointError,
    UnsafeEndpointError,
    check_client_endpoint,
    wants_ipv6,
)

#: How many ``fork()``s this process is from the one that imported the client:
#: each socket notes it when made (``process_generation``).
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


# Counted at each fork rather than asking ``os.getpid()`` per call (a system call,
# 0.2 us here, on every request).  A fork from C that does not exec is not seen.
os.register_at_fork(after_in_child=_forked)


def process_generation() -> int:
    """What ``check_process`` compares against: note it when a socket is made."""
    return _forks


def check_process(generation: int, what: str) -> None:
    """``ClientError`` when ``what`` (a socket made at ``generation``) is used in a
    child ``fork()`` made since: a ZeroMQ socket there has no I/O thread and its
    calls retry forever, whatever their timeout, and a ``shm.sock`` connection is
    the parent's too, so one process could read the other's replies."""
    if generation != _forks:
        raise ClientError(
            f"{what} was made in a parent of this process (before a fork()) and cannot be "
            "used here: make a new client in this process"
        )


def trusted_endpoint(endpoint: str) -> str:
    """``endpoint``; ``UnsafeEndpoint`` when it is a socket in a directory another
    user could write, ``Unreachable`` when that directory could not be checked (at
    the descriptor limit: a call may succeed once descriptors are free again),
    ``InvalidArgument`` when no socket can have its address."""
    try:
        return check_client_endpoint(endpoint)
    except UnsafeEndpointError as exc:
        raise UnsafeEndpoint(str(exc)) from None
    except UncheckedEndpointError as exc:
        raise Unreachable(str(exc)) from None
    except EndpointError as exc:
        raise InvalidArgument(str(exc)) from None


def connect(sock: zmq.Socket[Any], endpoint: str) -> None:
    """``sock.connect(endpoint)``; ``InvalidArgument`` naming the endpoint when ZeroMQ
    cannot parse it (``tcp://host`` without a port): the caller closes ``sock``."""
    try:
        sock.setsockopt(zmq.IPV6, wants_ipv6(endpoint))
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
