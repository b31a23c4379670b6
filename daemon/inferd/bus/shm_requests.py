"""Requests on ``shm.sock`` as the bus reads and answers them (DESIGN.md 104).

A message read from a shm connection (``shm.connections``) is a registration op,
answered at once by ``ShmConnections.answer``, or an infer request, which from
then on is a request like one from the infer socket: the same typed decoder,
checks, admission, deadlines and replies, routed back by the connection's
``route`` instead of a ZeroMQ routing id.  Its reply is one message: the header
alone, since every output of a request on this socket is placed in a region
(``codec.validate_outputs(every=True)``).

Where a request was read is told by that, never by its route's bytes: a ZeroMQ
peer chooses its own routing id, one shaped like a shm route too.  Only this
reader sets a request's ``local_uid`` (admission's rules, ``serving.requests``)
and carries its route as a ``ShmRoute`` (its job's late check and its reply's
way back, ``serving.engine_worker``, ``bus.server``).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog

from inferd.bus.codec import Limits, Request, decode_header
from inferd.bus.dispatch import Dispatcher
from inferd.bus.handler import Prepared, Reply, RequestHandler, error_reply
from inferd.bus.headers import InferHeader, id_of_oversized
from inferd.bus.repeats import Repeat, repeat_of
from inferd.shm.connections import ShmConnection, ShmConnections
from inferd.shm.messages import Message, fitted
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES, SHM_OPS

log = structlog.get_logger("inferd.bus")

#: What a shm connection's messages may ask for.
_OPS = [*SHM_OPS, "infer"]
#: A plain int: ``int & socket.MSG_TRUNC`` goes through ``enum.Flag`` (a few us).
_MSG_TRUNC = int(socket.MSG_TRUNC)


class ShmRoute(bytes):
    """A shm connection's route in the envelope of a request read on ``shm.sock``:
    its type, which no ZeroMQ routing id has (``codec.split_envelope``), sends the
    request's reply to that connection, whatever bytes a ZeroMQ peer chose.  Made per
    request (0.2 us)."""

    __slots__ = ()


def admit_shm_message(
    shm: ShmConnections,
    entry: ShmConnection,
    message: Message,
    handler: RequestHandler,
    dispatch: Dispatcher,
    limits: Limits,
) -> tuple[Reply | None, bool]:
    """Admit or answer the message read from ``entry``: the reply to send now, if
    any, and whether the message was an infer request (one ``shm.requests``
    counts; not a registration op, a message refused as no infer request, or the
    connection's end).  A repeat of an infer request admitted before on this
    connection is admitted from what that admission prepared (DESIGN.md 109)."""
    try:
        read, admit = _read_message(shm, entry, message, handler, limits)
    except Exception:  # a bug, an ``OSError`` mapping a memfd: that connection alone goes
        log.exception("shm_handler_failed", pid=entry.connection.peer.pid)
        shm.close(entry)
        return None, False
    finally:
        shm.discard_fds(entry, message)
    if read is None:
        return None, False
    request, refusal = read
    if refusal is not None:
        return error_reply(request, request.envelope, refusal), True
    return dispatch.answer(request, admit), True


def repeat_in(message: Message) -> Repeat | None:
    """``message`` split at the id it ends with (``bus.repeats``), when it is one
    whole message of bytes alone."""
    if message.fds or message.flags & _MSG_TRUNC:
        return None
    return repeat_of(message.data)


def _read_message(
    shm: ShmConnections,
    entry: ShmConnection,
    message: Message,
    handler: RequestHandler,
    limits: Limits,
) -> tuple[tuple[Request, ProtocolError | None] | None, Callable[[Request], Reply | None]]:
    """The infer request ``message`` carries, counted in flight on ``entry``, with
    the refusal its reply must carry when the connection has too many in flight,
    and what admits it; None for the request when the message was answered here
    (a registration op, a message no one could serve) or was the connection's
    end (closed once its requests in flight are answered)."""
    repeat = repeat_in(message)
    prepared = None if repeat is None else handler.prepared_for(entry.route, repeat.prefix)
    if prepared is not None and repeat is not None:
        admit: Callable[[Request], Reply | None] = partial(handler.admit_prepared, prepared)
        return _read_repeat(shm, entry, prepared, repeat), admit
    return _read(shm, entry, message, limits, repeat), handler.handle_infer


def _read(
    shm: ShmConnections,
    entry: ShmConnection,
    message: Message,
    limits: Limits,
    repeat: Repeat | None,
) -> tuple[Request, ProtocolError | None] | None:
    if message.unread:
        shm.leave_unread(entry)
        return None
    if message.closed:
        shm.end_of_input(entry)
        return None
    if message.flags & _MSG_TRUNC:
        error = f"message is over {MAX_SHM_MESSAGE_BYTES} bytes"
        shm.refuse(entry, None, ProtocolError(Code.INVALID_ARGUMENT, error))
        return None
    try:
        request = decode_header(message.data, limits, typed=True)
    except ProtocolError as exc:
        shm.refuse(entry, id_of_oversized(message.data, limits.max_header_bytes), exc)
        return None
    if request.op in SHM_OPS:
        header = request.header
        if not isinstance(header, dict):  # a register without a label reads as typed
            header = protocol.unpack_header(message.data, check_version=False)
        try:
            protocol.require_str_keys(header)
        except ProtocolError as exc:
            shm.refuse(entry, request.request_id, exc)
            return None
        shm.answer(entry, message, header)
        return None
    if request.op != "infer" or message.fds:
        error = (
            "an infer request carries no descriptor"
            if request.op == "infer"
            else f"unknown op {request.op!r} on the shm socket; it serves {_OPS}"
        )
        shm.refuse(entry, request.request_id, ProtocolError(Code.INVALID_ARGUMENT, error))
        return None
    request.envelope = [ShmRoute(entry.route)]
    request.local_uid = entry.connection.peer.uid
    typed = isinstance(request.header, InferHeader)
    if typed and repeat is not None and request.request_id == repeat.request_id:
        request.repeat = repeat.prefix  # the id is the header's last value
    return _admit(shm, entry, request)


def _read_repeat(
    shm: ShmConnections, entry: ShmConnection, prepared: Prepared, repeat: Repeat
) -> tuple[Request, ProtocolError | None]:
    """A repeat: the header of the request ``prepared`` was made from, with the id
    this message carries (``bus.repeats``)."""
    request = Request(
        envelope=[ShmRoute(entry.route)],
        header=prepared.header,
        request_id=repeat.request_id,
        op="infer",
        tensors=[],
        local_uid=entry.connection.peer.uid,
        repeat=repeat.prefix,
    )
    return _admit(shm, entry, request)


def _admit(
    shm: ShmConnections, entry: ShmConnection, request: Request
) -> tuple[Request, ProtocolError | None]:
    try:
        shm.admit(entry)  # from here on its reply goes through ShmConnections.reply
    except ProtocolError as exc:
        return request, exc
    return request, None


def send_shm_reply(shm: ShmConnections, parts: list[Any]) -> None:
    """Send a reply (``[route, header]``) to its shm connection: one message."""
    route, header = parts[0], parts[1]
    if len(parts) == 2 and len(header) > MAX_SHM_MESSAGE_BYTES:
        header = _refitted(header)
    if len(parts) > 2 or len(header) > MAX_SHM_MESSAGE_BYTES:
        # Never expected (every output is placed; headers are small): answered with
        # what went wrong rather than cut short.
        log.error("shm_reply_unsendable", frames=len(parts) - 2, header_bytes=len(header))
        request_id = None
        with contextlib.suppress(ProtocolError):
            request_id = protocol.request_id_of(protocol.unpack_header(header))
        header = protocol.pack(
            protocol.error_header(
                request_id,
                Code.INTERNAL,
                "the reply carries tensor bytes or a header over "
                f"{MAX_SHM_MESSAGE_BYTES} bytes, which the shm socket cannot",
            )
        )
    shm.reply(route, header)


def _refitted(header: bytes) -> bytes:
    """An error reply over the bound (its message quotes the request: a long model
    name, escaped) cut to fit, keeping its code (``shm.messages.fitted``); any other
    reply as it is."""
    with contextlib.suppress(ProtocolError):
        unpacked = protocol.unpack_header(header, len(header))
        if unpacked.get("ok") is False:
            return fitted(unpacked)
    return header
