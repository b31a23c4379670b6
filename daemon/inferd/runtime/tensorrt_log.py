"""TensorRT's one logger per process, routed to whoever is calling TensorRT.

TensorRT keeps a single logger pointer for the whole process: a builder,
runtime or refitter created with another logger while one exists gets a
warning and its messages go to the first logger; and a Python logger that is
garbage collected while TensorRT still points at it is a use-after-free
(NVIDIA/TensorRT#1475; DESIGN.md, "One TensorRT logger per process").  So
inferd creates exactly one ``trt.ILogger`` subclass instance per TensorRT
module (``process_logger``), keeps it for the life of the process and gives it
to every ``Builder``, ``Runtime`` and ``OnnxParser``.

TensorRT reports *why* something failed only through that logger
(``deserialize_cuda_engine`` just returns None), and several owners use
TensorRT in one process (two models' runtimes, a build and its validation
runtime), each needing the messages of its own calls.  A ``TensorRTLog`` is one
owner's view: inside ``with tlog.scope():`` the process logger hands what
TensorRT logs *on that thread* to that owner, which forwards warnings and
errors to structlog (with the owner's name) and keeps the recent ones in a ring
so a failing call can say what TensorRT said (``explain_failure``).  TensorRT
calls the logger on the thread that made the API call; a message from a thread
with no scope (one of TensorRT's own) is logged as ``owner=None``, never lost
and never given to an owner it may not belong to.  The ring is a ``deque``
(atomic appends) and the sequence counter only advances under the GIL, so no
lock is needed there.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
from collections import deque
from collections.abc import Iterator
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


class _Routing(threading.local):
    """The owners in scope on one thread, innermost last."""

    def __init__(self) -> None:
        self.owners: list[TensorRTLog] = []


_routing = _Routing()
_lock = threading.Lock()
#: One logger per TensorRT module object, kept with its module for the life of the
#: process (never collected: TensorRT may still hold its pointer).  A process has
#: one ``tensorrt``; the tests build several fake ones.
_loggers: dict[int, tuple[Any, Any]] = {}


def _deliver(severity: Any, message: str) -> None:
    owners = _routing.owners
    if owners:
        owners[-1].receive(severity_name(severity), str(message))
    else:
        _forward(severity_name(severity), str(message), owner=None, verbose=False)


def process_logger(trt: Any) -> Any:
    """The one ``trt.ILogger`` of this process for the module ``trt``."""
    with _lock:
        known = _loggers.get(id(trt))
        if known is not None:
            return known[1]

        class InferdTensorRTLogger(trt.ILogger):  # type: ignore[misc]
            def __init__(self) -> None:
                trt.ILogger.__init__(self)

            def log(self, severity: Any, msg: str) -> None:
                _deliver(severity, msg)

        logger = InferdTensorRTLogger()
        _loggers[id(trt)] = (trt, logger)
        return logger


def _forward(severity: str, message: str, *, owner: str | None, verbose: bool) -> None:
    if severity in _ERRORS:
        log.error("tensorrt_log", severity=severity, message=message, owner=owner)
    elif severity == "WARNING":
        log.warning("tensorrt_log", severity=severity, message=message, owner=owner)
    elif verbose or severity == "INFO":
        log.debug("tensorrt_log", severity=severity, message=message, owner=owner)


class TensorRTLog:
    """One owner's share of the process logger (``.logger``): what TensorRT logs on a
    thread inside ``scope()`` is this owner's.  ``owner`` names it in log lines
    (``model demo``, ``build demo.onnx``)."""

    def __init__(self, trt: Any, *, owner: str, verbose: bool = False) -> None:
        self.logger: Any = process_logger(trt)
        self.owner = owner
        self._seq = itertools.count(1)
        self._last = 0
        self._messages: deque[tuple[int, str, str]] = deque(maxlen=_RING)
        self._verbose = verbose

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Route what TensorRT logs on this thread to this owner until the block ends."""
        owners = _routing.owners
        owners.append(self)
        try:
            yield
        finally:
            owners.pop()

    def receive(self, severity: str, message: str) -> None:
        if severity in _KEPT:
            sequence = next(self._seq)
            self._last = sequence
            self._messages.append((sequence, severity, message))
        _forward(severity, message, owner=self.owner, verbose=self._verbose)

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
