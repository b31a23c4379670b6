"""NVML (``nvidia-ml-py``, module ``pynvml``) for one GPU: the one place that
imports ``pynvml``, initializes NVML and looks a device up.

``pynvml`` is imported inside ``handle_for_cuda_device`` only, so importing this
module costs nothing on a host without NVML (a Jetson, a CI runner).

NVML counts ``nvmlInit`` / ``nvmlShutdown`` pairs itself (as does pynvml) and
shuts down only when the count reaches zero.  Each ``NvmlDevice`` therefore
owns exactly one init and gives it back exactly once in ``close``: the engine
host probe and the thermal source can hold NVML at the same time without
ending each other's session, and no process-wide state lives here.

``handle_for_cuda_device`` finds the GPU a CUDA device number names.  NVML
numbers GPUs its own way (PCI bus order in practice, "no guarantees of
consistency between reboots" in its reference) and ignores
``CUDA_VISIBLE_DEVICES``; CUDA numbers the devices it is allowed to see, fastest
first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.  NVIDIA's reference recommends
looking a device up "by their PCI ids or GPU UUID", so the CUDA device's PCI bus
id (pycuda's ``Device.pci_bus_id()``, ``cuDeviceGetPCIBusId``: ``0000:3B:00.0``)
is handed to ``nvmlDeviceGetHandleByPciBusId`` (the ``_v2`` entry point in
nvidia-ml-py, which accepts ``domain:bus:device.function`` with any number of
hex digits, so CUDA's 4-digit domain and NVML's own 8-digit ``busId`` both
match).
"""

from __future__ import annotations

import contextlib
import os
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
    ``NVMLError``); ``handle`` is the device handle for ``index`` (the CUDA device
    number given to ``handle_for_cuda_device``);
    ``matched_by`` says how the handle was found, for logs."""

    def __init__(self, nvml: Any, handle: Any, index: int, matched_by: str = "") -> None:
        self.nvml = nvml
        self.handle = handle
        self.index = index
        self.matched_by = matched_by or f"NVML index {index}"
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


def _initialized() -> Any:
    """``pynvml`` after a successful ``nvmlInit``; ``NvmlUnavailableError`` otherwise."""
    try:
        import pynvml
    except Exception as exc:  # ImportError, or a broken install raising anything
        raise NvmlUnavailableError(f"nvml: pynvml is not importable: {exc}") from exc
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
        raise NvmlUnavailableError(f"nvml: nvmlInit failed: {exc}") from exc
    return pynvml


def _handle_by_index(nvml: Any, index: int) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        raise NvmlUnavailableError(f"nvml: no device {index}: {exc}") from exc


def handle_for_cuda_device(device_id: int) -> NvmlDevice:
    """Initialize NVML and return the GPU that CUDA numbers ``device_id`` in this
    process (``runtime.device_id``); ``NvmlUnavailableError`` naming why otherwise,
    never another GPU.  On failure nothing stays initialized.

    * NVML sees one GPU: that one (by index, as before: a one-GPU host's and a
      Jetson's engine names and thermal readings are unchanged; a Jetson's iGPU
      has no PCI bus id NVML can look up).
    * Several, pycuda importable: by the CUDA device's PCI bus id.
    * Several, no pycuda: only under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, where CUDA
      numbers GPUs by ascending PCI bus id (its device ``k`` is the ``k``-th
      entry of ``CUDA_VISIBLE_DEVICES`` when that lists GPU numbers); otherwise
      CUDA's order is unspecified ("fastest first") and the device is refused.
    """
    pynvml = _initialized()
    try:
        handle, matched_by = _find_cuda_device(pynvml, device_id)
    except BaseException:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        raise
    return NvmlDevice(pynvml, handle, device_id, matched_by)


def _find_cuda_device(nvml: Any, device_id: int) -> tuple[Any, str]:
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as exc:
        raise NvmlUnavailableError(f"nvml: cannot count GPUs: {exc}") from exc
    if count <= 1:
        # The only GPU NVML sees is the only one CUDA can be given.
        return _handle_by_index(nvml, device_id), "the only GPU NVML sees"
    bus_id, no_pycuda = _cuda_pci_bus_id(device_id)
    if bus_id is None:
        return _by_pci_order(nvml, count, device_id, no_pycuda)
    try:
        return nvml.nvmlDeviceGetHandleByPciBusId(bus_id), f"PCI bus id {bus_id}"
    except Exception as exc:
        raise NvmlUnavailableError(
            f"nvml: CUDA device {device_id} (PCI bus id {bus_id}) is none of NVML's "
            f"{count} GPUs: {exc}"
        ) from exc


def _cuda_pci_bus_id(device_id: int) -> tuple[str | None, str]:
    """CUDA's PCI bus id of its device ``device_id`` (``cuInit`` and a device query:
    no context is created), or None and why pycuda cannot be imported."""
    try:
        import pycuda.driver as cuda
    except Exception as exc:
        return None, f"pycuda is not importable: {exc}"
    try:
        cuda.init()
        return str(cuda.Device(device_id).pci_bus_id()), ""
    except Exception as exc:  # pycuda._driver.Error: no device, invalid ordinal
        raise NvmlUnavailableError(
            f"nvml: cannot read CUDA device {device_id}'s PCI bus id through pycuda: {exc}"
        ) from exc


def _by_pci_order(nvml: Any, count: int, device_id: int, no_pycuda: str) -> tuple[Any, str]:
    ambiguous = (
        f"nvml: NVML sees {count} GPUs and which one is CUDA's device {device_id} is "
        f"ambiguous ({no_pycuda})"
    )
    order = os.environ.get("CUDA_DEVICE_ORDER")
    if order != "PCI_BUS_ID":
        raise NvmlUnavailableError(
            f"{ambiguous}: CUDA_DEVICE_ORDER is {order or 'unset'}, so CUDA numbers GPUs "
            "fastest first in an unspecified order; install pycuda or set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    numbers = list(range(count)) if visible is None else _gpu_numbers(visible, count)
    if numbers is None or not 0 <= device_id < len(numbers):
        raise NvmlUnavailableError(
            f"{ambiguous}: CUDA_VISIBLE_DEVICES={visible!r} is not a list of distinct GPU "
            f"numbers below {count} that has a device {device_id}"
        )
    try:
        located = []
        for index in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            info = nvml.nvmlDeviceGetPciInfo(handle)
            located.append(((int(info.domain), int(info.bus), int(info.device)), handle))
    except Exception as exc:
        raise NvmlUnavailableError(f"{ambiguous}: cannot read GPU {index}'s PCI id: {exc}") from exc
    located.sort(key=lambda item: item[0])
    (domain, bus, device), handle = located[numbers[device_id]]
    return handle, f"PCI order ({domain:04X}:{bus:02X}:{device:02X}.0)"


def _gpu_numbers(visible: str, count: int) -> list[int] | None:
    """``CUDA_VISIBLE_DEVICES`` as GPU numbers, or None for anything else (UUIDs, MIG
    devices, repeats, out of range: CUDA's handling of those is not reproduced here)."""
    entries = [entry.strip() for entry in visible.split(",")] if visible.strip() else []
    if not all(entry.isascii() and entry.isdigit() for entry in entries):
        return None
    numbers = [int(entry) for entry in entries]
    if len(set(numbers)) != len(numbers) or any(number >= count for number in numbers):
        return None
    return numbers
