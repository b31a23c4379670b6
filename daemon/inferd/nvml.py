"""NVML (``nvidia-ml-py``, module ``pynvml``) for one GPU: the one place that
imports ``pynvml``, initializes NVML and looks a device up.

``pynvml`` is imported inside ``open_device`` only, so importing this module
costs nothing on a host without NVML (a Jetson, a CI runner).

NVML counts ``nvmlInit`` / ``nvmlShutdown`` pairs itself (as does pynvml) and
shuts down only when the count reaches zero.  Each ``NvmlDevice`` therefore
owns exactly one init and gives it back exactly once in ``close``: the engine
host probe and the thermal source can hold NVML at the same time without
ending each other's session, and no process-wide state lives here.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

from inferd.errors import InferdError


class NvmlUnavailableError(InferdError):
    """NVML cannot be used: ``pynvml`` missing, ``nvmlInit`` failed or no such device.

    The message starts with ``nvml:`` and names the step that failed; callers
    re-raise it as their own error (host tuple, telemetry)."""


class NvmlDevice:
    """An NVML session holding one device handle.

    ``nvml`` is the ``pynvml`` module (callers need its functions, constants and
    ``NVMLError``); ``handle`` is the device handle for ``index``."""

    def __init__(self, nvml: Any, handle: Any, index: int) -> None:
        self.nvml = nvml
        self.handle = handle
        self.index = index
        self._closed = False

    def close(self) -> None:
        """Give back this session's ``nvmlInit``; later calls do nothing.

        Raises what ``nvmlShutdown`` raises (the first time only); callers
        choose whether that is worth a log line."""
        if self._closed:
            return
        self._closed = True
        self.nvml.nvmlShutdown()

    def __enter__(self) -> NvmlDevice:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Leaving a probe: a failed shutdown must not hide the probe's result.
        with contextlib.suppress(Exception):
            self.close()


def open_device(index: int) -> NvmlDevice:
    """Initialize NVML and return GPU ``index``; ``NvmlUnavailableError`` otherwise.

    On failure nothing stays initialized."""
    try:
        import pynvml
    except Exception as exc:  # ImportError, or a broken install raising anything
        raise NvmlUnavailableError(f"nvml: pynvml is not importable: {exc}") from exc
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
        raise NvmlUnavailableError(f"nvml: nvmlInit failed: {exc}") from exc
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        raise NvmlUnavailableError(f"nvml: no device {index}: {exc}") from exc
    return NvmlDevice(pynvml, handle, index)
