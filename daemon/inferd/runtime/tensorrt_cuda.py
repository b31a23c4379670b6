"""A ``tensorrt`` runtime's CUDA context and stream, and the section that makes
them current on the calling thread (see ``inferd.runtime.tensorrt``: a runtime
is used from the switch thread and the engine worker, and a CUDA context is
current per thread)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import structlog

from inferd.errors import InferenceError, RuntimeNotAvailableError

LABEL = "tensorrt"

log = structlog.get_logger("inferd.runtime.tensorrt")


class CudaContext:
    """The runtime's CUDA context and stream, and the section that makes them current."""

    def __init__(self, cuda: Any, device_id: int) -> None:
        self.module = cuda
        self.lock = threading.RLock()
        try:
            cuda.init()
            context = cuda.Device(device_id).make_context()
        except cuda.Error as exc:
            raise RuntimeNotAvailableError(
                LABEL, f"CUDA device {device_id} cannot be opened ({exc})"
            ) from None
        # make_context leaves the new context current on this thread.
        try:
            self.stream: Any = cuda.Stream()
        except cuda.Error as exc:
            with contextlib.suppress(cuda.Error):
                context.detach()
            raise RuntimeNotAvailableError(
                LABEL, f"cannot create a CUDA stream on device {device_id} ({exc})"
            ) from None
        cuda.Context.pop()
        self.context: Any = context

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """Hold the lock and make the context current on this thread; pop it after."""
        with self.lock:
            if self.context is None:
                raise InferenceError("the tensorrt runtime has been closed")
            try:
                self.context.push()
            except self.module.Error as exc:
                raise InferenceError(f"cannot make the CUDA context current: {exc}") from exc
            try:
                yield
            finally:
                try:
                    self.module.Context.pop()
                except self.module.Error as exc:  # pragma: no cover - driver failure
                    log.error("cuda_context_pop_failed", error=str(exc))
