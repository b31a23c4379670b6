"""Second review of builds: the daemon's reader of a build child's pipe is bounded.

msgpack buffered up to 100 MiB of one unfinished message per build, and past that
``Decoder.feed`` raised ``BufferFull`` (its promise: a bad message is refused,
never raised), which ended the reader thread while the child kept writing.
"""

from __future__ import annotations

from structlog.testing import capture_logs

from inferd.engine_build.pipe import ErrorMessage, child_message_decoder, encode

CHUNK = 65536  # what the daemon's reader reads at once


def test_a_message_past_the_bound_is_refused_and_the_rest_of_the_stream_dropped() -> None:
    huge = encode(ErrorMessage("x" * (17 << 20)))  # larger than any report a child sends
    after = ErrorMessage("a message after the oversized one")
    stream = huge + encode(after)
    decoder = child_message_decoder(build_id="b1-abc")
    received = []
    with capture_logs() as logs:
        for start in range(0, len(stream), CHUNK):
            received += decoder.feed(stream[start : start + CHUNK])
    assert received == [], "an oversized message was buffered whole and delivered"
    assert decoder.malformed == 1 and decoder.broken is not None
    refused = [e for e in logs if e["event"] == "build_pipe_malformed_message"]
    assert len(refused) == 1 and "larger than" in refused[0]["why"]
