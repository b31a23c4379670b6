"""What a reply must be for the client to accept it: as strict as the JSON Schemas
(schemas/bus/infer_reply.json, error_reply.json), as the C++ client (clients/cpp)
is too; schemas/conformance holds the vectors both are checked against."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
_INFER_REPLY_KEYS = frozenset(INFER_REPLY_FIELDS)
_RUNTIMES = ("tensorrt", "onnx_trt_ep")
_THERMAL_SUMMARIES = ("nominal", "throttling", "unknown")


def _uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: The type of each typed key of an infer reply (``outputs``: ``decode_outputs``).
_INFER_REPLY_CHECKS: dict[str, Callable[[Any], bool]] = {
    "model": lambda value: isinstance(value, str) and bool(value),
    "runtime": lambda value: value in _RUNTIMES,
    "fallback": lambda value: isinstance(value, bool),
    "latency_us": _uint,
    "queue_us": _uint,
    "late": lambda value: isinstance(value, bool),
    "thermal": lambda value: value in _THERMAL_SUMMARIES,
}


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


def result_of(reply: Mapping[str, Any]) -> dict[str, Any]:
    """A control reply's ``result`` map; ``RemoteError`` for an error reply,
    ``MalformedReply`` for an ok one without it."""
    raise_if_error(reply)
    result = reply.get("result")
    if not isinstance(result, dict):
        raise MalformedReply(f"reply has no 'result' map: {reply!r:.200}")
    return dict(result)


def check_infer_reply(header: Mapping[str, Any], model: str | None = None) -> None:
    """A successful infer reply carries exactly ``INFER_REPLY_FIELDS``, typed as
    infer_reply.json says (the outputs are checked by ``decode_outputs``), and, given
    ``model``, the model the request named: another's answer is no answer to it."""
    keys = header.keys()
    if keys != _INFER_REPLY_KEYS:
        missing = sorted(_INFER_REPLY_KEYS - keys)
        unknown = sorted(keys - _INFER_REPLY_KEYS)
        raise MalformedReply(f"infer reply: missing keys {missing}, unknown keys {unknown}")
    wrong = [key for key, check in _INFER_REPLY_CHECKS.items() if not check(header[key])]
    if wrong:
        raise MalformedReply(f"infer reply: {wrong} do not have the protocol's types: {header!r}")
    if model is not None and header["model"] != model:
        raise MalformedReply(
            f"infer reply names the model {header['model']!r:.80}; the request named {model!r:.80}"
        )
