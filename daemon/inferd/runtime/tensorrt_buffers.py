"""Pinned host and device buffers for one engine's IO tensors, and dtype mapping.

Each IO tensor gets one page-locked host buffer (``pycuda.driver.pagelocked_empty``,
so ``memcpy_*_async`` really is asynchronous) and one device buffer
(``pycuda.driver.mem_alloc``), allocated the first time the tensor is used and
reallocated only when a request needs more bytes than they hold (a dynamic
shape grew).  Buffers are raw bytes; a request views the first ``nbytes`` with
its dtype and shape.  Every call here must run with the runtime's CUDA context
current (inside ``TensorRTRuntime``'s CUDA section).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferd.errors import EngineDeserializeError

#: ``trt.DataType`` member names -> numpy dtype names (the wire vocabulary).
#: BF16, FP8, INT4 and FP4 have no numpy/wire type and are refused at load.
TRT_DTYPE_NAMES: tuple[tuple[str, str], ...] = (
    ("FLOAT", "float32"),
    ("HALF", "float16"),
    ("INT8", "int8"),
    ("INT32", "int32"),
    ("INT64", "int64"),
    ("BOOL", "bool"),
    ("UINT8", "uint8"),
)
#: Smallest allocation: TensorRT wants a non-null, 256-byte aligned address even
#: for an empty tensor; mem_alloc(0) is an error.
MIN_BUFFER_BYTES = 256


def numpy_dtype_name(trt: Any, dtype: Any, *, tensor: str) -> str:
    for trt_name, numpy_name in TRT_DTYPE_NAMES:
        if hasattr(trt.DataType, trt_name) and dtype == getattr(trt.DataType, trt_name):
            return numpy_name
    name = getattr(dtype, "name", str(dtype))
    raise EngineDeserializeError(
        f"tensor {tensor!r} has TensorRT type {name}, which inferd cannot carry "
        "(supported: " + ", ".join(numpy for _, numpy in TRT_DTYPE_NAMES) + ")"
    )


@dataclass
class IOBuffer:
    host: Any  # page-locked uint8 ndarray
    device: Any  # pycuda DeviceAllocation
    capacity: int

    @property
    def address(self) -> int:
        return int(self.device)

    def host_bytes(self, nbytes: int) -> np.ndarray:
        view: np.ndarray = self.host[:nbytes]
        return view

    def host_view(self, nbytes: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        view: np.ndarray = self.host[:nbytes].view(dtype).reshape(shape)
        return view


@dataclass
class IOBuffers:
    """The buffers of one resident engine, by tensor name."""

    cuda: Any
    buffers: dict[str, IOBuffer] = field(default_factory=dict)
    allocations: int = 0

    @property
    def device_bytes(self) -> int:
        return sum(buffer.capacity for buffer in self.buffers.values())

    def capacity_after(self, required: dict[str, int]) -> int:
        """Device bytes held once ``required`` (tensor -> bytes) is satisfied."""
        names = set(self.buffers) | set(required)
        total = 0
        for name in names:
            current = self.buffers[name].capacity if name in self.buffers else 0
            total += max(current, _capacity(required.get(name, 0)))
        return total

    def ensure(self, name: str, nbytes: int) -> tuple[IOBuffer, bool]:
        """The buffer for ``name`` holding at least ``nbytes``; True when it was
        (re)allocated, so its device address changed."""
        buffer = self.buffers.get(name)
        if buffer is not None and buffer.capacity >= nbytes:
            return buffer, False
        capacity = _capacity(nbytes)
        device = self.cuda.mem_alloc(capacity)
        try:
            host = self.cuda.pagelocked_empty((capacity,), np.uint8)
        except BaseException:
            device.free()
            raise
        if buffer is not None:
            self.buffers.pop(name)
            _free(buffer)
        fresh = IOBuffer(host=host, device=device, capacity=capacity)
        self.buffers[name] = fresh
        self.allocations += 1
        return fresh, True

    def free_all(self) -> None:
        while self.buffers:
            _, buffer = self.buffers.popitem()
            _free(buffer)


def _capacity(nbytes: int) -> int:
    return max(nbytes, MIN_BUFFER_BYTES)


def _free(buffer: IOBuffer) -> None:
    # Explicit frees, inside the caller's CUDA section, rather than whenever the
    # garbage collector runs (possibly on another thread, without the context).
    with contextlib.suppress(Exception):
        buffer.device.free()
    allocation = getattr(buffer.host, "base", None)
    free = getattr(allocation, "free", None)
    if callable(free):
        with contextlib.suppress(Exception):
            free()
