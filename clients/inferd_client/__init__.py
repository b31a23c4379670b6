"""Client library for the inferd inference daemon (pyzmq, msgpack, numpy only)."""

from inferd_client.client import InferenceClient, OperatorClient
from inferd_client.errors import (
    ClientError,
    ConnectionLost,
    ConnectionRefused,
    InvalidArgument,
    MalformedReply,
    RemoteError,
    RequestTimeout,
    Unreachable,
    UnsafeEndpoint,
)
from inferd_client.events import EventSubscriber
from inferd_client.region import SharedRegion
from inferd_wire.curve import ClientCurve, CurveKeyError
from inferd_wire.endpoints import Endpoints, default_endpoints
from inferd_wire.protocol import Code

__all__ = [
    "ClientCurve",
    "ClientError",
    "Code",
    "ConnectionLost",
    "ConnectionRefused",
    "CurveKeyError",
    "Endpoints",
    "EventSubscriber",
    "InferenceClient",
    "InvalidArgument",
    "MalformedReply",
    "OperatorClient",
    "RemoteError",
    "RequestTimeout",
    "SharedRegion",
    "Unreachable",
    "UnsafeEndpoint",
    "default_endpoints",
]
