"""A socket thread's bind outcome, handed to the thread that started it.

The daemon reports ready only once every socket is bound, and a bind failure
(address in use, a bad endpoint, a refused security option) must surface in the
starting thread as the exception itself, not end quietly with the socket thread.
"""

from __future__ import annotations

import threading


class BindOutcome:
    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._settled = threading.Event()
        self._error: BaseException | None = None

    def bound(self) -> None:
        self._settled.set()

    def failed(self, error: BaseException) -> None:
        self._error = error
        self._settled.set()

    def wait(self, timeout: float) -> None:
        """Return once bound; raise the bind failure, or ``TimeoutError``."""
        if not self._settled.wait(timeout):
            raise TimeoutError(f"{self._thread_name} did not bind in time")
        if self._error is not None:
            raise self._error
