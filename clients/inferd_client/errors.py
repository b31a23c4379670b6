"""Exceptions raised by the client library."""

from __future__ import annotations


class ClientError(Exception):
    """Base of every error the client library raises."""


class RemoteError(ClientError):
    """The daemon answered with ``ok: false``; ``code`` is one of ``protocol.Code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RequestTimeout(ClientError):
    """No reply arrived within the timeout, after every allowed retry."""


class Unreachable(ClientError):
    """The daemon's socket is not there, could not be connected to, was closed by the
    daemon, or stayed silent (no event at all) for the timeout."""


class ConnectionLost(Unreachable):
    """The connection ended while a request waited for its reply: a reply frame over
    the client's ``max_reply_frame_bytes`` (libzmq ends the connection as the
    frame's length arrives, unread), or the daemon closed it (it stopped or
    restarted, or a request frame was over its ``ZMQ_MAXMSGSIZE``); the client's
    monitor cannot tell them apart.  The client connects again for the next call;
    the request may or may not have run."""


class ConnectionRefused(Unreachable):
    """The daemon refused this client's connection at its handshake (its ZAP handler,
    ``ZMQ_EVENT_HANDSHAKE_FAILED_AUTH``): its access policy does not admit this
    client (its user, group, host or CURVE key), or this peer (a local user, a
    remote host) holds more than ``bus.max_connections`` connections to that
    socket.  Raised at once, not after the timeout; nothing was sent.  The daemon's
    log says why (``peer_refused``), and ``status`` counts it
    (``security.sockets.<socket>.connections_refused``).  The next call connects
    anew.  ``status`` is the ZAP status code (400: refused; 500: the daemon's
    handler failed)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class InvalidArgument(ClientError, ValueError):
    """What the caller asked for cannot be sent or done (a dtype the wire has no name
    for, a malformed endpoint, an array that cannot take an output); nothing was sent.
    Also a ``ValueError``, as Python callers expect of a bad argument."""


class MalformedReply(ClientError):
    """The daemon's reply broke the wire contract (a bug on one side)."""


class UnsafeEndpoint(ClientError):
    """An ipc:// endpoint in a directory another user could write: not connected to
    (a socket there may not be the daemon's)."""
