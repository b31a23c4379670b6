"""The fuzz harness's short version (``bench/fuzz.py``): thousands of malformed
messages at a real daemon's infer, control and shm sockets, each answered once
with its own id (or ``null`` when the id was unreadable), none with
``INTERNAL``, the daemon still serving afterwards and holding no region once the
shm connection has closed."""

from __future__ import annotations

import pytest

from tests.conftest import bench_result

pytestmark = pytest.mark.integration


def test_malformed_floods_are_each_answered_once_and_the_daemon_keeps_serving() -> None:
    result = bench_result("fuzz.py", "--infer", "1500", "--control", "500", "--shm", "1000")
    for socket, sent in (("infer", 1500), ("control", 500), ("shm", 1000)):
        summary = result[socket]
        assert (summary["sent"], summary["replies"]) == (sent, sent)
        assert summary["codes"]["INVALID_ARGUMENT"] > sent / 2, summary  # mostly refused
        assert "INTERNAL" not in summary["codes"]
    assert result["daemon_alive"] and result["daemon_serving"]
    # Valid requests among the malformed ones were served on shm.sock too, and what
    # the fuzzer's connection registered went with it.
    assert result["shm"]["codes"]["OK"] > 0
    assert result["regions_left"] == 0
