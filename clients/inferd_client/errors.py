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


class MalformedReply(ClientError):
    """The daemon's reply broke the wire contract (a bug on one side)."""


class UnsafeEndpoint(ClientError):
    """An ipc:// endpoint in a directory another user could write: not connected to
    (a socket there may not be the daemon's)."""
