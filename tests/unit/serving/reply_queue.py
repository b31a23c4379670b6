"""A ``RequestPort`` without a socket, for engine-worker tests that hand jobs to
the scheduler themselves and read the worker's replies in order."""

from __future__ import annotations

import queue
from typing import Any

from inferd_wire import protocol
from tests.conftest import HANG_S


class ReplyQueue:
    """``serving.engine_worker.RequestPort``: never listens, queues each reply."""

    listen_fds: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.sent: queue.Queue[list[Any]] = queue.Queue()

    def worker_listening(self, listening: bool, last_run_ns: int = 0) -> None:
        raise AssertionError("a port without listen_fds is never listened on")

    def serve_one(self, ready: list[int]) -> bool:
        raise AssertionError("a port without listen_fds is never read")

    def send_reply(self, parts: list[Any]) -> None:
        self.sent.put(parts)

    def next_reply(self, envelope: list[bytes]) -> dict[str, Any]:
        """The next reply's header, checking that it goes back to ``envelope``."""
        parts = self.sent.get(timeout=HANG_S)
        assert parts[: len(envelope)] == envelope
        return protocol.unpack_header(parts[len(envelope)], 1 << 16)
