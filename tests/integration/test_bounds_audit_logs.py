"""What one client request can put in the daemon's log is bounded per line, not only
in lines (the repeat limiter: a few per event, model and code every 10 s).  A
refusal quotes what the client sent (an unknown op, a model or tensor name), and
a header may be ``bus.max_header_bytes`` (64 KiB) long, four times that once
escaped: one request made a 240 KB log line, and the journald writer queues up
to 4096 entries while journald does not read, each holding its fields twice."""

from __future__ import annotations

import pytest

from inferd.supervision.logging import MAX_FIELD_CHARS
from tests.conftest import DaemonFactory, wait_until
from tests.integration.wire import RawDealer, assert_error, pack

pytestmark = pytest.mark.integration


def test_a_refusal_quoting_a_huge_op_makes_a_log_line_of_bounded_size(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    op = "\x01" * 60_000  # a header within max_header_bytes; escaped, 4 characters each
    with RawDealer(daemon.control) as dealer:
        reply, _ = dealer.request([pack({"v": 1, "id": 7, "op": op})], timeout=10)
    assert_error(reply, "INVALID_ARGUMENT", "unknown control op", request_id=7)

    def refusal_lines() -> list[str]:
        return [line for line in daemon.log().splitlines() if "request_refused" in line]

    wait_until(lambda: refusal_lines() != [], message="the refusal logged")
    longest = max(len(line) for line in refusal_lines())
    assert longest < 3 * MAX_FIELD_CHARS, f"a log line of {longest} characters"
    assert "[cut:" in refusal_lines()[0]
