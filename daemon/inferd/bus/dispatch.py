"""From a received message to the service's answer: decode, check, hand it to
the ``RequestHandler``, and refuse what fails on the way (code and message,
counted and logged).  Both request sources use it, the ROUTER sockets and the
``shm.sock`` connections; ``bus.server`` reads and sends.  A repeat of an infer
request admitted before on the same connection is admitted from what that
admission prepared, on either source (DESIGN.md 109, 114)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import structlog
import zmq

from inferd.bus.codec import Limits, Request, check_request, decode_request, split_envelope
from inferd.bus.handler import Reply, RequestHandler, error_reply
from inferd.bus.headers import id_of_oversized
from inferd.bus.heap import BULK_RELEASE_BYTES, FRAME_OVERHEAD_BYTES
from inferd.bus.intake import Oversized
from inferd.bus.internal_errors import internal_message
from inferd.bus.repeats import MAX_REPEAT_BYTES, repeat_of
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError, RequestId

log = structlog.get_logger("inferd.bus")


class Dispatcher:
    """Called by one thread at a time, under the bus's handler lock."""

    def __init__(
        self, handler: RequestHandler, limits: Limits, request_trim: Callable[[], None]
    ) -> None:
        self._handler = handler
        self._limits = limits
        #: Asks for the heap to be trimmed (a large oversized message was let go).
        self._request_trim = request_trim
        #: Messages refused, for any reason.
        self.malformed = 0
        #: Messages refused for their frame count or bytes, and the bytes let go unread.
        self.oversized_messages = 0
        self.oversized_bytes = 0

    def message(self, frames: list[zmq.Frame], typed: bool) -> Reply | None:
        """Decode a ROUTER message (``typed``: an infer request) and answer it.  An
        infer header that ends with its id, whose bytes before it were admitted and
        prepared on this connection, is admitted from that preparation."""
        envelope, body = split_envelope(frames)
        repeat = None
        if typed and body and len(body[0]) <= MAX_REPEAT_BYTES:
            repeat = repeat_of(body[0].bytes)
        if repeat is not None:
            prepared = self._handler.prepared_for(envelope[0], repeat.prefix)
            if prepared is not None:
                request = Request(
                    envelope=envelope,
                    header=prepared.header,
                    request_id=repeat.request_id,
                    op="infer",
                    tensors=[part.buffer for part in body[1:]],
                    header_frame=body[0],
                    repeat=repeat.prefix,
                )
                return self.answer(request, partial(self._handler.admit_prepared, prepared))
        try:
            request = decode_request(body, self._limits, typed=typed)
        except ProtocolError as exc:  # its id, when it is refused for its size alone
            size = self._limits.max_header_bytes
            return self.refused(
                id_of_oversized(body[0].buffer, size) if body else None, envelope, exc
            )
        request.envelope = envelope
        if repeat is not None and request.request_id == repeat.request_id:
            request.repeat = repeat.prefix  # kept only for a typed header (_prepare)
        handle = self._handler.handle_infer if typed else self._handler.handle_control
        return self.answer(request, handle)

    def answer(self, request: Request, handle: Callable[[Request], Reply | None]) -> Reply | None:
        """Check a decoded request and hand it to ``handle``: its reply, or None
        when it was admitted."""
        try:
            check_request(request, self._limits)
            return handle(request)
        except ProtocolError as exc:
            return self.refused(request.request_id, request.envelope, exc)
        except Exception as exc:  # a handler bug must not take the bus down
            # Its text (paths, host names) goes to the log alone (bus.internal_errors).
            error = f"{type(exc).__name__}: {exc}"
            log.exception("request_handler_failed", request_id=request.request_id, error=error)
            what = f"the daemon failed to handle the request ({type(exc).__name__})"
            message = internal_message(what, "request_handler_failed", request.request_id)
            return error_reply(request, request.envelope, ProtocolError(Code.INTERNAL, message))

    def refused(
        self, request_id: RequestId | None, envelope: list[bytes], error: ProtocolError
    ) -> Reply:
        self.malformed += 1
        log.info("request_refused", code=str(error.code), reason=error.message)
        return Reply(envelope, protocol.error_header(request_id, error.code, error.message))

    def oversized(self, oversized: Oversized) -> Reply:
        """Answer a message the intake read to its end without keeping it."""
        self.oversized_messages += 1
        self.oversized_bytes += oversized.nbytes
        if oversized.nbytes + oversized.frames * FRAME_OVERHEAD_BYTES >= BULK_RELEASE_BYTES:
            self._request_trim()
        reply = oversized.reply(self._limits)
        self.malformed += 1
        log.info(
            "request_refused",
            code=reply.header["error"]["code"],
            reason=reply.header["error"]["message"],
            frames=oversized.frames,
            nbytes=oversized.nbytes,
        )
        return reply
