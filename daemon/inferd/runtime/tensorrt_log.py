"""TensorRT's logger, captured: forwarded to structlog and kept for error messages.

TensorRT reports *why* something failed only through its ``ILogger``
(``deserialize_cuda_engine`` just returns None).  ``TensorRTLog`` subclasses
``trt.ILogger`` (calling the base ``__init__``, as the bindings require),
forwards warnings and errors to structlog and keeps the recent ones in a ring
so a failing call can say what TensorRT said, turned into a plain sentence by
``explain_failure``.  TensorRT may log from several internal threads; the ring
is a ``deque`` (atomic appends) and the sequence counter is only advanced under
the GIL, so no lock is needed.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from typing import Any

import structlog

log = structlog.get_logger("inferd.runtime.tensorrt")

#: Severity names as the bindings spell them (``trt.ILogger.Severity.<NAME>``).
_ERRORS = frozenset({"INTERNAL_ERROR", "ERROR"})
_KEPT = _ERRORS | {"WARNING"}
_RING = 64


def severity_name(severity: Any) -> str:
    name = getattr(severity, "name", None)
    return name if isinstance(name, str) else str(severity).rsplit(".", 1)[-1]


class TensorRTLog:
    """Owns one ``trt.ILogger`` subclass instance (``.logger``) for a runtime or a
    build.  It must outlive every Builder/Runtime/engine created with it."""

    def __init__(self, trt: Any, *, verbose: bool = False) -> None:
        self._seq = itertools.count(1)
        self._last = 0
        self._messages: deque[tuple[int, str, str]] = deque(maxlen=_RING)
        self._verbose = verbose
        owner = self

        class _Logger(trt.ILogger):  # type: ignore[misc]
            def __init__(self) -> None:
                trt.ILogger.__init__(self)

            def log(self, severity: Any, msg: str) -> None:
                owner._log(severity_name(severity), str(msg))

        self.logger: Any = _Logger()

    def _log(self, severity: str, message: str) -> None:
        if severity in _KEPT:
            sequence = next(self._seq)
            self._last = sequence
            self._messages.append((sequence, severity, message))
        if severity in _ERRORS:
            log.error("tensorrt_log", severity=severity, message=message)
        elif severity == "WARNING":
            log.warning("tensorrt_log", severity=severity, message=message)
        elif self._verbose or severity == "INFO":
            log.debug("tensorrt_log", severity=severity, message=message)

    def mark(self) -> int:
        """A position: ``since(mark)`` returns what was logged after it."""
        return self._last

    def since(self, mark: int, *, errors_only: bool = True) -> list[str]:
        return [
            message
            for sequence, severity, message in list(self._messages)
            if sequence > mark and (severity in _ERRORS or not errors_only)
        ]


_VERSION = re.compile(r"expecting library version ([\w.]+) got ([\w.]+)", re.IGNORECASE)
_DEVICE = re.compile(r"expecting compute ([\d.]+) got compute ([\d.]+)", re.IGNORECASE)


def explain_failure(messages: list[str], *, action: str) -> str:
    """A plain sentence for what TensorRT logged while ``action`` failed
    (``action`` completes "TensorRT could not ...")."""
    text = " ".join(messages)
    lowered = text.lower()
    version = _VERSION.search(text)
    if version is not None:
        return (
            "the engine was built by a different TensorRT version "
            f"(this TensorRT is {version.group(1)}, the engine is from {version.group(2)}); "
            "rebuild it on this vehicle with `inferd build`"
        )
    if "version tag does not match" in lowered or "magic tag does not match" in lowered:
        return (
            "the engine was built by a different TensorRT version (or the file is not a "
            "TensorRT engine): its serialization tag does not match this TensorRT; rebuild it "
            "on this vehicle with `inferd build`"
        )
    device = _DEVICE.search(text)
    if device is not None or "incompatible device" in lowered:
        detail = (
            f" (this GPU is compute {device.group(1)}, the engine is for {device.group(2)})"
            if device is not None
            else ""
        )
        return f"the engine was built for a different GPU{detail}; rebuild it on this vehicle"
    if "platform specific tag mismatch" in lowered:
        return "the engine was built for a different platform (operating system or CPU)"
    if any(sign in lowered for sign in ("out of memory", "outofmemory", "could not be allocated")):
        return f"the GPU ran out of memory (TensorRT could not {action})"
    if "plugin" in lowered and ("not found" in lowered or "could not find" in lowered):
        return f"the engine needs a TensorRT plugin that is not loaded: {messages[-1]}"
    if messages:
        return f"TensorRT could not {action}: {messages[-1]}"
    return f"TensorRT could not {action} and logged no reason"
