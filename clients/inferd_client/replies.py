"""What a reply must be for the client to accept it: as strict as the JSON Schemas
(schemas/bus/infer_reply.json, error_reply.json), as the C++ client (clients/cpp)
is too; schemas/conformance holds the vectors both are checked against."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferd_client.errors import MalformedReply, RemoteError
from inferd_wire import protocol

#: Every key of a successful infer reply (schemas/bus/infer_reply.json, all
#: required): a reply with another key, or without one of these, is malformed.
#: The C++ client (clients/cpp) decodes the same set; schemas/conformance checks both.
INFER_REPLY_FIELDS = (
    "v",
    "id",
    "ok",
    "model",
    "runtime",
    "fallback",
    "latency_us",
    "queue_us",
    "late",
    "outputs",
    "thermal",
)
_RUNTIMES = ("tensorrt", "onnx_trt_ep")
_THERMAL_SUMMARIES = ("nominal", "throttling", "unknown")


def check_reply_id(header: Mapping[str, Any]) -> None:
    """A reply's id is a request id (an unsigned 64-bit integer or a 1..128 character
    string, never a boolean), or null in an error reply whose request was unreadable."""
    if header.get("id") is None and header.get("ok") is False:
        return
    if protocol.request_id_of(header) is None:
        raise MalformedReply(f"reply id {header.get('id')!r} is not a request id")


def raise_if_error(header: Mapping[str, Any]) -> None:
    """RemoteError for an error reply; MalformedReply for a reply that is neither."""
    if header.get("ok") is True:
        return
    error = header.get("error")
    if header.get("ok") is not False or not isinstance(error, dict):
        raise MalformedReply(f"reply is neither ok nor an error: {header!r}")
    code, message = error.get("code"), error.get("message")
    if code not in protocol.Code.__members__ or not isinstance(message, str):
        raise MalformedReply(f"error reply without a known code and a message: {error!r}")
    if set(header) != {"v", "id", "ok", "error"} or set(error) != {"code", "message"}:
        raise MalformedReply(f"error reply with keys the protocol does not have: {header!r}")
    raise RemoteError(str(code), message)


def check_infer_reply(header: Mapping[str, Any]) -> None:
    """A successful infer reply carries exactly ``INFER_REPLY_FIELDS``, typed as
    infer_reply.json says (the outputs are checked by ``decode_outputs``)."""
    keys = set(header)
    if keys != set(INFER_REPLY_FIELDS):
        missing = sorted(set(INFER_REPLY_FIELDS) - keys)
        unknown = sorted(keys - set(INFER_REPLY_FIELDS))
        raise MalformedReply(f"infer reply: missing keys {missing}, unknown keys {unknown}")

    def uint(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    checks = {
        "model": isinstance(header["model"], str) and bool(header["model"]),
        "runtime": header["runtime"] in _RUNTIMES,
        "fallback": isinstance(header["fallback"], bool),
        "latency_us": uint(header["latency_us"]),
        "queue_us": uint(header["queue_us"]),
        "late": isinstance(header["late"], bool),
        "thermal": header["thermal"] in _THERMAL_SUMMARIES,
    }
    wrong = [key for key, fine in checks.items() if not fine]
    if wrong:
        raise MalformedReply(f"infer reply: {wrong} do not have the protocol's types: {header!r}")
