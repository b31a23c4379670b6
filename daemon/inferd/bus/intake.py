"""Reading a ROUTER socket's messages frame by frame, within the message limits.

ZeroMQ hands a multipart message to the application only once all its frames
have arrived, and ``ZMQ_MAXMSGSIZE`` bounds each frame, not the message: what
ZeroMQ itself holds for one message is not bounded by any option (measured in
DESIGN.md 57).  What the daemon holds on top is bounded here.  Frames are
counted and their bytes summed as they are read; as soon as a message carries
more than ``max_frames`` tensor frames or more than ``max_message_bytes``
tensor bytes, the tensor frames read so far are let go, the rest of the
message is read and let go frame by frame (at most ``frames_per_call`` per
call, so the bus loop goes on serving between two calls) and the message is
answered once, with the counts of the whole message.  The routing envelope and
the header frame are kept so the refusal reaches the peer with its request id.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import zmq

from inferd.bus.codec import Limits, decode_request
from inferd.bus.handler import Reply
from inferd.bus.headers import id_of_oversized
from inferd.config.ceilings import MAX_HEADER_FRAME_BYTES
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError, RequestId

#: Frames read and let go per call while discarding an oversized message.
FRAMES_PER_CALL = 1024


@dataclass
class Oversized:
    """A message refused for its size, read to its end without being kept."""

    envelope: list[bytes]
    #: The header frame, kept to answer with the request's id (None when the
    #: message has no header, or one past ``MAX_HEADER_FRAME_BYTES``).
    header: zmq.Frame | None
    #: Tensor frames of the whole message and their bytes.
    frames: int
    nbytes: int
    complete: bool = False

    def reply(self, limits: Limits) -> Reply:
        """The refusal, with the request's id when its header is readable: decoded
        within ``max_header_bytes``, its id alone past it (``id_of_oversized``)."""
        request_id: RequestId | None = None
        if self.header is not None and len(self.header) > limits.max_header_bytes:
            request_id = id_of_oversized(self.header.buffer, limits.max_header_bytes)
        elif self.header is not None:
            with contextlib.suppress(ProtocolError):  # unreadable: answered without an id
                request_id = decode_request([self.header], limits).request_id
        error = self.error(limits)
        return Reply(self.envelope, protocol.error_header(request_id, error.code, error.message))

    def error(self, limits: Limits) -> ProtocolError:
        if self.frames > limits.max_frames:
            message = (
                f"message carries {self.frames} tensor frames; the limit is {limits.max_frames}"
            )
        else:
            message = (
                f"tensor frames hold {self.nbytes} bytes; the limit is {limits.max_message_bytes}"
            )
        return ProtocolError(Code.INVALID_ARGUMENT, message)


class Intake:
    """One socket's receiving side; ``receive`` is called by one thread at a time
    (the infer socket's under the bus's wire lock)."""

    def __init__(
        self, sock: zmq.Socket[Any], limits: Limits, frames_per_call: int = FRAMES_PER_CALL
    ) -> None:
        self.socket = sock
        self._limits = limits
        self._frames_per_call = frames_per_call
        #: The oversized message being discarded, between two calls.
        self._discarding: Oversized | None = None

    def receive(self) -> list[zmq.Frame] | Oversized | None:
        """The next whole message (``[routing id, (delimiter,) header, *tensors]``),
        an oversized one once it has been read to its end, or None: nothing is
        waiting, or this call's share of an oversized message has been discarded
        (the socket then stays readable)."""
        if self._discarding is None:
            started = self._start()
            if not isinstance(started, Oversized):
                return started
            self._discarding = started
        return self._discard(self._discarding)

    def _start(self) -> list[zmq.Frame] | Oversized | None:
        """Read a message while it is within the limits; an ``Oversized`` (the
        frames read so far let go with this function's locals) once it is not."""
        try:
            frame = self.socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [frame]
        body = 1  # index of the header frame: 2 after a REQ peer's empty delimiter
        nbytes = 0
        limits = self._limits
        while frame.more:
            frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            frames.append(frame)
            count = len(frames)
            if count == 2 and len(frame) == 0:
                body = 2
            elif count > body + 1:
                nbytes += len(frame)
                if count - body - 1 > limits.max_frames or nbytes > limits.max_message_bytes:
                    header = frames[body]
                    return Oversized(
                        envelope=[frames[0].bytes, b""] if body == 2 else [frames[0].bytes],
                        header=header if len(header) <= MAX_HEADER_FRAME_BYTES else None,
                        frames=count - body - 1,
                        nbytes=nbytes,
                        complete=not frame.more,
                    )
        return frames

    def _discard(self, discarding: Oversized) -> Oversized | None:
        for _ in range(self._frames_per_call):
            if discarding.complete:
                break
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # never expected: a message's frames arrive together
                return None
            discarding.frames += 1
            discarding.nbytes += len(frame)
            discarding.complete = not frame.more
        if not discarding.complete:
            return None
        self._discarding = None
        return discarding
