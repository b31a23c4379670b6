"""The check every client socket makes before it connects: the rules of
``inferd_wire.endpoints.check_client_endpoint``, raised as client errors."""

from __future__ import annotations

from inferd_client.errors import ClientError, UnsafeEndpoint
from inferd_wire.endpoints import EndpointError, UnsafeEndpointError, check_client_endpoint


def trusted_endpoint(endpoint: str) -> str:
    """``endpoint``; ``UnsafeEndpoint`` when it is a socket in a directory another
    user could write, ``ClientError`` when no socket can have its address."""
    try:
        return check_client_endpoint(endpoint)
    except UnsafeEndpointError as exc:
        raise UnsafeEndpoint(str(exc)) from None
    except EndpointError as exc:
        raise ClientError(str(exc)) from None
