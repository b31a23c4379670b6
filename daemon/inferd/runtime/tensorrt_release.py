"""Releasing TensorRT objects: explicitly, newest first, with their CUDA context current.

TensorRT objects free their GPU memory in the CUDA context that was current
when they were made; destroyed after that context was popped or detached,
they run their destructors in another context or none (CUDA errors, or a
crash at exit).  Python gives no order for the destruction of a frame's locals
and keeps them alive in a traceback, so code that makes TensorRT objects holds
them in a ``ReleaseStack`` and does its work in a function of its own: when the
function returns (or its traceback's frames are cleared with ``clear_frames``)
the stack holds the last references, and ``release`` drops them newest first
while the context is still current.  The bindings keep a factory alive while
what it made lives (``py::keep_alive``: a network or config its builder, an
engine its runtime), so newest-first also destroys children before factories.
"""

from __future__ import annotations

import gc
import traceback
from typing import Any, TypeVar

T = TypeVar("T")


class ReleaseStack:
    """TensorRT objects of one piece of work, released newest first by ``release``."""

    def __init__(self) -> None:
        self._objects: list[Any] = []

    def hold(self, obj: T) -> T:
        self._objects.append(obj)
        return obj

    def release(self) -> None:
        """Drop every held reference, newest first, then collect garbage once (call
        with the context current): a reference cycle, such as a caught exception
        whose traceback holds the frames that made the objects, would otherwise keep
        them alive until some later collection, in whatever context is current then.
        Work that holds TensorRT objects is rare (a build, a cache check), and one
        collection costs milliseconds."""
        while self._objects:
            self._objects.pop()
        gc.collect()


def clear_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame in ``exc``'s tracebacks (and its causes'):
    they may be the last references to TensorRT objects, which must be destroyed
    while their context is current, not whenever the exception is collected."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]
