"""A fake ``pynvml`` module mimicking nvidia-ml-py 12.x (12.535+, where the
``nvmlDeviceGetCurrentClocksEventReasons`` name and the
``nvmlClocksEventReason*`` constants exist next to the deprecated
``...ThrottleReasons`` names).  Every name and constant value here was checked
against nvidia-ml-py 13.615.71's ``pynvml.py`` too (jetson-stats 7.2.2 requires
>= 13.595.45), where ``nvmlDeviceGetTemperature`` and the ``...ThrottleReasons``
function are marked deprecated but still work.

``make_module(state)`` builds a fresh module object holding only names the real
binding has (a subset of them); anything else raises ``AttributeError``, as on
the real module.  The test drives it through the ``FakeNvml`` state object,
which is *not* part of the module.  Inject it with
``monkeypatch.setitem(sys.modules, "pynvml", make_module(state))`` so the code
under test imports ``pynvml`` normally.

Real behaviour kept: ``nvmlInit`` is refcounted and every device call raises
``NVMLError_Uninitialized`` before it; ``NVMLError(value)`` returns the
subclass for that value (``NVMLError_LibraryNotFound`` etc.), ``.value``
holds the code and ``str()`` the NVML error string.

Device identity (for the engine host tuple): ``nvmlDeviceGetName(handle)``
returns ``str`` as 12.x does (its ``@convertStrBytes`` decodes the C string;
set ``FakeNvml.name_as_bytes`` to mimic the older bindings that return
``bytes``) and ``nvmlDeviceGetCudaComputeCapability(handle)`` returns the
``(major, minor)`` tuple of ints.

Build evidence: ``nvmlSystemGetDriverVersion()`` returns ``str`` (needs
``nvmlInit`` like every call), ``nvmlDeviceGetComputeRunningProcesses(handle)``
a list of objects with ``pid`` and ``usedGpuMemory`` (``None`` where NVML says
the value is not available, as the real binding maps
``NVML_VALUE_NOT_AVAILABLE``), ``nvmlDeviceGetMemoryInfo(handle)`` an object
with ``total``, ``free`` and ``used`` in bytes.

Usage (metrics): ``nvmlDeviceGetUtilizationRates(handle)`` an object with
``gpu`` and ``memory`` percentages, ``nvmlDeviceGetPowerUsage(handle)`` the
draw in milliwatts; either raises ``NVMLError_NotSupported`` when its
``FakeNvml`` field is None (as an iGPU or a MIG slice does).

Several GPUs (``FakeNvml.gpus``, in NVML's index order; NVML ignores
``CUDA_VISIBLE_DEVICES``, so the fake never reads it): each has its own name,
compute capability, temperature and PCI bus id.  As in nvidia-ml-py 12.x/13.x
(checked against 13.615.71): ``nvmlDeviceGetHandleByPciBusId(pciBusId)`` is
wrapped in ``@convertStrBytes`` (a ``str`` is encoded, ``bytes`` pass through)
and hands a ``c_char_p`` to ``nvmlDeviceGetHandleByPciBusId_v2``, so anything
else raises ``TypeError``; NVML parses the id as hex numbers in the three forms
its reference accepts (``domain:bus:device.function``, ``domain:bus:device``,
``bus:device.function``; any number of digits, either case), answers
``NVML_ERROR_INVALID_ARGUMENT`` for anything else and ``NVML_ERROR_NOT_FOUND``
when no GPU has that id (a Jetson iGPU's "Bus-Id N/A": ``pci_bus_id=None``).
``nvmlDeviceGetPciInfo(handle)`` (``_v3`` underneath) returns an object with
the ints ``domain``, ``bus``, ``device`` and the ``bytes`` ``busId``
(``00000000:3B:00.0``, 8-digit domain) and ``busIdLegacy`` (4-digit domain),
as ctypes returns ``c_char`` arrays.  Without ``gpus``, ``device_count`` GPUs
share the scalar fields and GPU ``i`` sits at ``00000000:{i+1:02X}:00.0``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_TEMPERATURE_THRESHOLD_MEM_MAX = 2
NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 3
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_CLOCK_VIDEO = 3

REASON_BITS = {
    "GpuIdle": 0x1,
    "ApplicationsClocksSetting": 0x2,
    "SwPowerCap": 0x4,
    "HwSlowdown": 0x8,
    "SyncBoost": 0x10,
    "SwThermalSlowdown": 0x20,
    "HwThermalSlowdown": 0x40,
    "HwPowerBrakeSlowdown": 0x80,
    "DisplayClockSetting": 0x100,
}
SW_THERMAL = REASON_BITS["SwThermalSlowdown"]
HW_THERMAL = REASON_BITS["HwThermalSlowdown"]
SW_POWER_CAP = REASON_BITS["SwPowerCap"]


class NVMLError(Exception):
    _valClassMapping: dict[int, type[NVMLError]] = {}

    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return _ERROR_STRINGS.get(self.value, "Unknown Error")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


def _error_class(name: str, value: int) -> type[NVMLError]:
    cls = type(f"NVMLError_{name}", (NVMLError,), {})
    NVMLError._valClassMapping[value] = cls
    return cls


NVMLError_Uninitialized = _error_class("Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _error_class("NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _error_class("DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_LibraryNotFound = _error_class("LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _error_class("FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND)
NVMLError_GpuIsLost = _error_class("GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_Unknown = _error_class("Unknown", NVML_ERROR_UNKNOWN)


class _Device:
    """Stands for the real ``c_nvmlDevice_t`` pointer: opaque to callers."""

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass
class FakeNvmlGpu:
    """One GPU of a several-GPU fake host (``FakeNvml.gpus``)."""

    name: str
    compute_capability: tuple[int, int]
    #: NVML's ``busId`` (``00000000:3B:00.0``); None: NVML has none (a Jetson iGPU).
    pci_bus_id: str | None
    temperature_c: int = 50


def parse_pci_bus_id(text: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) from the forms NVML's reference accepts, else None."""
    head, dot, function = text.rpartition(".") if "." in text else (text, "", "0")
    parts = head.split(":")
    if len(parts) == 2 and dot:
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    try:
        domain, bus, device, fn = (int(part, 16) for part in (*parts, function))
    except ValueError:
        return None
    return domain, bus, device, fn


@dataclass
class FakeNvml:
    """What the fake driver reports; tests change it between polls.

    ``errors`` maps a function name to an NVML error code it raises on every
    call until removed (``nvmlInit`` included).
    """

    device_count: int = 1
    temperature_c: int = 50
    reasons: int = 0
    sm_clock_mhz: int = 1410
    slowdown_threshold_c: int | None = 90
    #: False mimics bindings before the "EventReasons" rename (older 12.x).
    has_event_reasons: bool = True
    #: What nvmlDeviceGetName / nvmlDeviceGetCudaComputeCapability report.
    device_name: str = "NVIDIA RTX A2000 12GB"
    compute_capability: tuple[int, int] = (8, 6)
    #: True mimics bindings before ``convertStrBytes`` (name returned as bytes).
    name_as_bytes: bool = False
    driver_version: str = "550.54.15"
    #: pid -> usedGpuMemory (None: not available) for nvmlDeviceGetComputeRunningProcesses.
    processes: dict[int, int | None] = field(default_factory=dict)
    memory_total_bytes: int = 12 * 1024**3
    memory_used_bytes: int = 1024**3
    #: nvmlDeviceGetUtilizationRates().gpu and nvmlDeviceGetPowerUsage() (mW); None: not supported.
    utilization_pct: int | None = 37
    power_mw: int | None = 61_250
    #: Several GPUs, in NVML's index order; empty: ``device_count`` alike GPUs.
    gpus: list[FakeNvmlGpu] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    init_count: int = 0
    shutdown_calls: int = 0
    calls: list[str] = field(default_factory=list)


def make_module(state: FakeNvml) -> types.ModuleType:
    module = types.ModuleType("pynvml", "fake nvidia-ml-py 12.x (tests/fakes/fake_pynvml.py)")

    def enter(name: str) -> None:
        state.calls.append(name)
        code = state.errors.get(name)
        if code is not None:
            raise NVMLError(code)

    def device(name: str, handle: Any) -> None:
        enter(name)
        if state.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, _Device):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlInit() -> None:
        enter("nvmlInit")
        state.init_count += 1

    def nvmlShutdown() -> None:
        enter("nvmlShutdown")
        state.shutdown_calls += 1
        if state.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        state.init_count -= 1

    def count() -> int:
        return len(state.gpus) if state.gpus else state.device_count

    def gpu(handle: _Device) -> FakeNvmlGpu | None:
        return state.gpus[handle.index] if state.gpus else None

    def bus_id(index: int) -> str | None:
        return state.gpus[index].pci_bus_id if state.gpus else f"00000000:{index + 1:02X}:00.0"

    def nvmlDeviceGetCount() -> int:
        enter("nvmlDeviceGetCount")
        if state.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return count()

    def nvmlDeviceGetHandleByIndex(index: int) -> _Device:
        enter("nvmlDeviceGetHandleByIndex")
        if state.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < count():
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Device(index)

    def nvmlDeviceGetHandleByPciBusId(pciBusId: Any) -> _Device:
        enter("nvmlDeviceGetHandleByPciBusId")
        if isinstance(pciBusId, str):  # @convertStrBytes
            pciBusId = pciBusId.encode()
        if not isinstance(pciBusId, bytes):  # c_char_p(...)
            raise TypeError(
                f"bytes or integer address expected instead of {type(pciBusId).__name__} instance"
            )
        if state.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        wanted = parse_pci_bus_id(pciBusId.decode("ascii", "replace"))
        if wanted is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for index in range(count()):
            known = bus_id(index)
            if known is not None and parse_pci_bus_id(known) == wanted:
                return _Device(index)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetPciInfo(handle: Any) -> Any:
        device("nvmlDeviceGetPciInfo", handle)
        known = bus_id(handle.index)
        parsed = parse_pci_bus_id(known) if known is not None else None
        if known is None or parsed is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        domain, bus, dev, function = parsed
        return types.SimpleNamespace(
            busIdLegacy=f"{domain:04X}:{bus:02X}:{dev:02X}.{function:X}".encode(),
            domain=domain,
            bus=bus,
            device=dev,
            pciDeviceId=0x10DE,
            pciSubSystemId=0,
            busId=f"{domain:08X}:{bus:02X}:{dev:02X}.{function:X}".encode(),
        )

    def nvmlDeviceGetTemperature(handle: Any, sensor: int) -> int:
        device("nvmlDeviceGetTemperature", handle)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        one = gpu(handle)
        return state.temperature_c if one is None else one.temperature_c

    def nvmlDeviceGetTemperatureThreshold(handle: Any, threshold: int) -> int:
        device("nvmlDeviceGetTemperatureThreshold", handle)
        if threshold != NVML_TEMPERATURE_THRESHOLD_SLOWDOWN or state.slowdown_threshold_c is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return state.slowdown_threshold_c

    def nvmlDeviceGetCurrentClocksEventReasons(handle: Any) -> int:
        device("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return state.reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(handle: Any) -> int:
        device("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return state.reasons

    def nvmlDeviceGetClockInfo(handle: Any, clock_type: int) -> int:
        device("nvmlDeviceGetClockInfo", handle)
        if clock_type != NVML_CLOCK_SM:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return state.sm_clock_mhz

    def nvmlDeviceGetName(handle: Any) -> str | bytes:
        device("nvmlDeviceGetName", handle)
        one = gpu(handle)
        name = state.device_name if one is None else one.name
        return name.encode() if state.name_as_bytes else name

    def nvmlDeviceGetCudaComputeCapability(handle: Any) -> tuple[int, int]:
        device("nvmlDeviceGetCudaComputeCapability", handle)
        one = gpu(handle)
        major, minor = state.compute_capability if one is None else one.compute_capability
        return (major, minor)

    def nvmlSystemGetDriverVersion() -> str:
        enter("nvmlSystemGetDriverVersion")
        if state.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return state.driver_version

    def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list[Any]:
        device("nvmlDeviceGetComputeRunningProcesses", handle)
        return [
            types.SimpleNamespace(pid=pid, usedGpuMemory=used)
            for pid, used in state.processes.items()
        ]

    def nvmlDeviceGetMemoryInfo(handle: Any) -> Any:
        device("nvmlDeviceGetMemoryInfo", handle)
        used = state.memory_used_bytes
        return types.SimpleNamespace(
            total=state.memory_total_bytes, free=state.memory_total_bytes - used, used=used
        )

    def nvmlDeviceGetUtilizationRates(handle: Any) -> Any:
        device("nvmlDeviceGetUtilizationRates", handle)
        if state.utilization_pct is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(gpu=state.utilization_pct, memory=state.utilization_pct // 2)

    def nvmlDeviceGetPowerUsage(handle: Any) -> int:
        device("nvmlDeviceGetPowerUsage", handle)
        if state.power_mw is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return state.power_mw

    functions = [
        nvmlInit,
        nvmlShutdown,
        nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetHandleByPciBusId,
        nvmlDeviceGetPciInfo,
        nvmlDeviceGetTemperature,
        nvmlDeviceGetTemperatureThreshold,
        nvmlDeviceGetCurrentClocksThrottleReasons,
        nvmlDeviceGetClockInfo,
        nvmlDeviceGetName,
        nvmlDeviceGetCudaComputeCapability,
        nvmlSystemGetDriverVersion,
        nvmlDeviceGetComputeRunningProcesses,
        nvmlDeviceGetMemoryInfo,
        nvmlDeviceGetUtilizationRates,
        nvmlDeviceGetPowerUsage,
    ]
    if state.has_event_reasons:
        functions.append(nvmlDeviceGetCurrentClocksEventReasons)
    for function in functions:
        setattr(module, function.__name__, function)

    for name, value in globals().items():
        if name.startswith(("NVML_", "NVMLError")):
            setattr(module, name, value)
    for reason, bit in REASON_BITS.items():
        setattr(module, f"nvmlClocksThrottleReason{reason}", bit)
        if state.has_event_reasons:
            setattr(module, f"nvmlClocksEventReason{reason}", bit)
    return module
