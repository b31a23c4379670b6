"""What a client is told when the daemon, not its request, failed (``INTERNAL``).

An exception's text is for the operator.  ONNX Runtime's CUDA errors carry the
host's name (``hostname=...``) and its build's source paths; inferd's own errors
name the models and engines on disk; a traceback's text can hold anything.  Sent
verbatim, it tells every client on the infer socket how the vehicle is laid out,
in words it can do nothing with.  So an ``INTERNAL`` reply says what failed, in
the daemon's own fixed words (the exception's type at most), and where the full
text is: the log event and the request's id, which the event carries
(``journalctl -u inferd INFERD_REQUEST_ID=<id>``).

The same holds for two replies of other codes whose cause is the daemon's, not
the request's: ``RESOURCE_EXHAUSTED`` for a run that ran out of memory (ONNX
Runtime's text of a CUDA out-of-memory names the host) and ``UNAVAILABLE`` for a
model that failed (its ``last_error`` names the model's files; operators read it
in ``status`` and ``health`` on the control socket).  Replies of the other codes
keep their specific messages: they say what the request got wrong or what it
waits for (``INVALID_ARGUMENT`` names the tensor and the dimension), which the
client needs to act on.
"""

from __future__ import annotations

from inferd.errors import OutOfMemoryError
from inferd_wire.protocol import Code, RequestId


def internal_message(what: str, event: str, request_id: RequestId | None = None) -> str:
    """An ``INTERNAL`` reply's message: ``what`` failed (fixed words, never an
    exception's text) and the log ``event`` holding why, with ``request_id`` when
    the event can occur more than once."""
    where = f"{event}, request id {request_id}" if request_id is not None else event
    return f"{what}; the daemon's log has why ({where})"


def run_failure(exc: Exception) -> tuple[Code, str]:
    """The code of a failed run and its fixed words for ``internal_message``: memory
    that ran out (host or GPU) is ``RESOURCE_EXHAUSTED``, worth a retry; any other
    failure is the daemon's, ``INTERNAL``."""
    if isinstance(exc, OutOfMemoryError):
        return Code.RESOURCE_EXHAUSTED, "the inference ran out of memory"
    return Code.INTERNAL, f"the inference failed ({type(exc).__name__})"


def unavailable_message(model: str, state: str) -> str:
    """An ``UNAVAILABLE`` reply's message for a model in ``state`` (not serving),
    without its ``last_error``: where to read why a failed one failed."""
    if state != "failed":
        return f"model {model!r} is {state}"
    return (
        f"model {model!r} is failed (it failed to load, or to fail over); "
        "the daemon's status and log have why (model_unavailable)"
    )
