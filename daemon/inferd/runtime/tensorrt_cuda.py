"""A ``tensorrt`` runtime's CUDA context and stream.

``CudaContext`` makes one context on ``runtime.device_id``
(``Device.make_context``) and a stream in it, then pops it: it is current on
no thread between calls.  Every section that touches CUDA or TensorRT pushes
it and pops it again (``CudaContext.section``), because a runtime is not used from
one thread only: make-before-break switching prepares (deserializes,
warms up) on a switch thread while the engine worker serves from the previous
runtime, and the worker then runs ``infer`` and ``release_engine``.  A CUDA
context is current per thread, and TensorRT and pycuda act on whichever one is
current, so without the push the worker would run this engine in no context
(or in another runtime's).  pycuda's ``detach`` only really detaches a context
that is current (or on its creating thread), so ``close`` pushes it first.
A section also routes what TensorRT logs on this thread to the runtime's
``TensorRTLog`` (TensorRT has one logger per process: ``tensorrt_log``).
A lock serialises sections of one runtime; two runtimes never share a context.
The context is made with ``ctx_flags.MAP_HOST``, without which CUDA ignores the
``DEVICEMAP`` flag of a host registration (``tensorrt_host``); ``integrated``
(``device_attribute.INTEGRATED``: a Jetson's GPU shares the host's DRAM) decides
whether TensorRT reads registered host memory in place or by DMA.
``close`` (also run when the runtime is garbage collected) releases every
engine and detaches the context.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import structlog

from inferd.errors import InferenceError, RuntimeNotAvailableError
from inferd.runtime.tensorrt_log import TensorRTLog
from inferd.runtime.tensorrt_release import clear_frames

LABEL = "tensorrt"

log = structlog.get_logger("inferd.runtime.tensorrt")


class CudaContext:
    """The runtime's CUDA context and stream, and the section that makes them current."""

    def __init__(self, cuda: Any, device_id: int, tlog: TensorRTLog) -> None:
        self.module = cuda
        self.tlog = tlog
        self.lock = threading.RLock()
        try:
            cuda.init()
            device = cuda.Device(device_id)
            self.integrated = bool(device.get_attribute(cuda.device_attribute.INTEGRATED))
            context = device.make_context(cuda.ctx_flags.MAP_HOST)
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
        """Hold the lock, make the context current on this thread and route TensorRT's
        messages to this runtime; pop the context after.  An exception leaving the
        section has its finished frames cleared first (``clear_frames``): their locals
        (an engine, an execution context) must not outlive the section in a
        traceback, to be destroyed later in another context or none."""
        with self.lock, self.tlog.scope():
            if self.context is None:
                raise InferenceError("the tensorrt runtime has been closed")
            try:
                self.context.push()
            except self.module.Error as exc:
                raise InferenceError(f"cannot make the CUDA context current: {exc}") from exc
            try:
                yield
            except BaseException as exc:
                clear_frames(exc)
                raise
            finally:
                try:
                    self.module.Context.pop()
                except self.module.Error as exc:  # pragma: no cover - driver failure
                    log.error("cuda_context_pop_failed", error=str(exc))


#: CUDA's sticky errors as ``cuGetErrorString`` words them (pycuda puts that text
#: after "<call> failed: ", TensorRT's logger inside "Cuda Runtime (...)"): the CUDA
#: driver API says each "leaves the process in an inconsistent state and any further
#: CUDA work will return the same error"; pycuda has no error code to test instead.
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",  # CUDA_ERROR_ILLEGAL_ADDRESS (700)
    "the launch timed out and was terminated",  # CUDA_ERROR_LAUNCH_TIMEOUT (702)
    "device-side assert triggered",  # CUDA_ERROR_ASSERT (710)
    "hardware stack error",  # CUDA_ERROR_HARDWARE_STACK_ERROR (714)
    "an illegal instruction was encountered",  # CUDA_ERROR_ILLEGAL_INSTRUCTION (715)
    "misaligned address",  # CUDA_ERROR_MISALIGNED_ADDRESS (716)
    "operation not supported on global/shared address space",  # (717)
    "invalid program counter",  # CUDA_ERROR_INVALID_PC (718)
    "unspecified launch failure",  # CUDA_ERROR_LAUNCH_FAILED (719)
)


def is_sticky_cuda_error(text: str) -> bool:
    """True when ``text`` (a pycuda error, or what TensorRT logged) names a sticky
    CUDA error: the context that raised it cannot run anything again."""
    lowered = text.lower()
    return any(error in lowered for error in STICKY_CUDA_ERRORS)
