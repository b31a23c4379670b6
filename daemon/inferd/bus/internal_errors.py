"""What a client is told when the daemon, not its request, failed (``INTERNAL``).

An exception's text is for the operator.  ONNX Runtime's CUDA errors carry the
host's name (``hostname=...``) and its build's source paths; inferd's own errors
name the models and engines on disk; a traceback's text can hold anything.  Sent
verbatim, it tells every client on the infer socket how the vehicle is laid out,
in words it can do nothing with.  So an ``INTERNAL`` reply says what failed, in
the daemon's own fixed words (the exception's type at most), and where the full
text is: the log event and the request's id, which the event carries
(``journalctl -u inferd INFERD_REQUEST_ID=<id>``).

Replies of the other codes keep their specific messages: they say what the
request got wrong or what it waits for (``INVALID_ARGUMENT`` names the tensor
and the dimension), which the client needs to act on.
"""

from __future__ import annotations

from inferd_wire.protocol import RequestId


def internal_message(what: str, event: str, request_id: RequestId | None = None) -> str:
    """An ``INTERNAL`` reply's message: ``what`` failed (fixed words, never an
    exception's text) and the log ``event`` holding why, with ``request_id`` when
    the event can occur more than once."""
    where = f"{event}, request id {request_id}" if request_id is not None else event
    return f"{what}; the daemon's log has why ({where})"
