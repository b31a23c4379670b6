"""A fake ``pycuda`` package mimicking pycuda 2024.1's driver API (``pycuda.driver``),
the subset inferd uses to identify a GPU.

``make_modules(state)`` returns ``{"pycuda": package, "pycuda.driver": driver}``;
inject both with ``monkeypatch.setitem(sys.modules, name, module)`` (or
``install(monkeypatch, state)``) so ``import pycuda.driver as cuda`` works as
usual.  Only names the real module has exist; anything else raises
``AttributeError``, as on the real module.

Real behaviour kept (from ``src/wrapper/wrap_cudadrv.cpp``):

* ``init(flags=0)`` (``cuInit``); with no device it raises
  ``pycuda.driver.RuntimeError`` ("cuInit failed: no CUDA-capable device is
  detected"), since CUDA_ERROR_NO_DEVICE maps to ``RuntimeError``.
* ``Device(ordinal)`` before ``init`` raises ``LogicError`` ("cuDeviceGet failed:
  initialization error"); a bad ordinal raises ``LogicError`` ("cuDeviceGet
  failed: invalid device ordinal").
* ``Device.count()`` (static), ``Device.name() -> str``,
  ``Device.compute_capability() -> (major, minor)``,
  ``Device.total_memory() -> int``.
* The exception family: ``Error`` and its subclasses ``LogicError``,
  ``RuntimeError``, ``LaunchError``, ``MemoryError`` (also a builtin
  ``MemoryError``).

Contexts, streams and memory are not faked here (the TensorRT runtime's tests
extend this module); using them raises ``AttributeError``.
"""

from __future__ import annotations

import builtins
import sys
import types
from dataclasses import dataclass, field

import pytest

MIMICS = "pycuda 2024.1 (pycuda.driver)"


class Error(Exception):
    pass


class LogicError(Error):
    pass


class LaunchError(Error):
    pass


class _DriverRuntimeError(Error):
    pass


class _DriverMemoryError(Error, builtins.MemoryError):
    pass


_DriverRuntimeError.__name__ = _DriverRuntimeError.__qualname__ = "RuntimeError"
_DriverMemoryError.__name__ = _DriverMemoryError.__qualname__ = "MemoryError"
for _cls in (Error, LogicError, LaunchError, _DriverRuntimeError, _DriverMemoryError):
    _cls.__module__ = "pycuda._driver"


@dataclass
class FakeGpu:
    name: str = "Orin"
    compute_capability: tuple[int, int] = (8, 7)
    total_memory: int = 62 * 1024**3


@dataclass
class FakeCuda:
    """What the fake driver reports; ``calls`` records every driver call by name."""

    devices: list[FakeGpu] = field(default_factory=lambda: [FakeGpu()])
    initialized: bool = False
    calls: list[str] = field(default_factory=list)


def make_modules(state: FakeCuda) -> dict[str, types.ModuleType]:
    package = types.ModuleType("pycuda", f"fake {MIMICS} (tests/fakes/fake_pycuda.py)")
    package.__path__ = []  # a package, as the real one
    driver = types.ModuleType("pycuda.driver", f"fake {MIMICS}")

    def init(flags: int = 0) -> None:
        state.calls.append("init")
        if flags != 0:
            raise LogicError("cuInit failed: invalid value")
        if not state.devices:
            raise _DriverRuntimeError("cuInit failed: no CUDA-capable device is detected")
        state.initialized = True

    class Device:
        def __init__(self, ordinal: int) -> None:
            state.calls.append("Device")
            if not state.initialized:
                raise LogicError("cuDeviceGet failed: initialization error")
            if not 0 <= ordinal < len(state.devices):
                raise LogicError("cuDeviceGet failed: invalid device ordinal")
            self._gpu = state.devices[ordinal]

        @staticmethod
        def count() -> int:
            state.calls.append("Device.count")
            if not state.initialized:
                raise LogicError("cuDeviceGetCount failed: initialization error")
            return len(state.devices)

        def name(self) -> str:
            state.calls.append("Device.name")
            return self._gpu.name

        def compute_capability(self) -> tuple[int, int]:
            state.calls.append("Device.compute_capability")
            major, minor = self._gpu.compute_capability
            return (major, minor)

        def total_memory(self) -> int:
            state.calls.append("Device.total_memory")
            return self._gpu.total_memory

    Device.__module__ = "pycuda._driver"
    driver.init = init  # type: ignore[attr-defined]
    driver.Device = Device  # type: ignore[attr-defined]
    driver.Error = Error  # type: ignore[attr-defined]
    driver.LogicError = LogicError  # type: ignore[attr-defined]
    driver.LaunchError = LaunchError  # type: ignore[attr-defined]
    driver.RuntimeError = _DriverRuntimeError  # type: ignore[attr-defined]
    driver.MemoryError = _DriverMemoryError  # type: ignore[attr-defined]
    package.driver = driver  # type: ignore[attr-defined]
    return {"pycuda": package, "pycuda.driver": driver}


def install(monkeypatch: pytest.MonkeyPatch, state: FakeCuda) -> FakeCuda:
    for name, module in make_modules(state).items():
        monkeypatch.setitem(sys.modules, name, module)
    return state
