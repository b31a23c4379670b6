"""A fake ``pycuda`` package mimicking pycuda 2024.1's driver API (``pycuda.driver``):
device identity (for the engine host tuple) and the contexts, streams, pinned
host memory, device memory and async copies the TensorRT runtime uses.

``make_modules(state)`` returns ``{"pycuda": package, "pycuda.driver": driver}``;
inject both with ``monkeypatch.setitem(sys.modules, name, module)`` (or
``install(monkeypatch, state)``) so ``import pycuda.driver as cuda`` works as
usual.  Only names the real module has exist; anything else raises
``AttributeError``, as on the real module (the classes use ``__slots__``, so
setting an attribute the real object lacks fails too).

Real behaviour kept (from ``src/wrapper/wrap_cudadrv.cpp`` and ``src/cpp/cuda.hpp``):

* ``init(flags=0)`` (``cuInit``); with no device it raises
  ``pycuda.driver.RuntimeError`` ("cuInit failed: no CUDA-capable device is
  detected"), since CUDA_ERROR_NO_DEVICE maps to ``RuntimeError``.
* ``Device(ordinal)`` before ``init`` raises ``LogicError`` ("cuDeviceGet failed:
  initialization error"); a bad ordinal raises ``LogicError`` ("cuDeviceGet
  failed: invalid device ordinal").
* ``Device.count()`` (static), ``Device.name() -> str``,
  ``Device.compute_capability() -> (major, minor)``,
  ``Device.total_memory() -> int``, ``Device.make_context(flags=0)``,
  ``Device.pci_bus_id() -> str`` (``cuDeviceGetPCIBusId`` into a 1024-byte
  buffer, pycuda's ``device::pci_bus_id``: ``[domain]:[bus]:[device].[function]``
  in hex with a 4-digit domain, ``0000:3B:00.0``; a Jetson's iGPU, on no PCI
  bus, reports ``0000:00:00.0``).
* Which devices CUDA numbers, and how: with ``FakeCuda.environ`` set (pass
  ``os.environ`` after ``monkeypatch.setenv``), ``init`` reads
  ``CUDA_DEVICE_ORDER`` and ``CUDA_VISIBLE_DEVICES`` from it as ``cuInit``
  does: ``devices`` is then the host's GPUs in the driver's fastest-first
  order, ``PCI_BUS_ID`` sorts them by PCI bus id, and ``CUDA_VISIBLE_DEVICES``
  (GPU numbers in that order) keeps the listed ones, in the listed order, up to
  the first entry that is not one (CUDA's documented rule; UUIDs are not
  modelled).  With ``environ`` None (the default) ``devices`` is what CUDA
  numbers, whatever the test process's environment holds.
* Contexts live on a per-thread stack (pycuda's ``context_stack`` is
  thread-specific): ``make_context`` pushes the new context on the calling
  thread; ``Context.push()`` (method) pushes on the calling thread;
  ``Context.pop()`` (static) pops the calling thread's top, ``LogicError`` when
  it has none; ``Context.get_current()`` (static) is the top or None;
  ``Context.synchronize()`` (static) completes the current context's streams;
  ``detach()`` really detaches only if the context is current on this thread
  (it is then popped) or this is its creating thread; otherwise the real
  pycuda leaks it silently (``context::detach``: "In all likelihood, this
  context's managing thread has exited ... No need to harp on the fact",
  its warning commented out): the context and all its memory stay for the
  process's life.  ``FakeCuda.leaked_contexts`` counts that, and it is a
  violation.
* pycuda's context stack is per thread (``boost::thread_specific_ptr<context_stack>``)
  and ``context_stack::~context_stack()`` aborts the process ("PyCUDA ERROR: The
  context stack was not empty upon module cleanup. ... The program will be
  aborted now. Use Context.pop() to avoid this problem.") when a thread ends with
  a context still pushed: a thread other than the main one that ends so is a
  violation here (the main thread's stack goes at interpreter exit, which the
  fake does not watch).
* Calls that need a context (``mem_alloc``, ``pagelocked_empty``, ``Stream``,
  copies) raise ``LogicError("... failed: invalid device context")`` when none
  is current on the calling thread, and when the memory or stream belongs to
  another context than the current one.
* ``mem_alloc(bytes) -> DeviceAllocation`` (``int()``, ``__index__``,
  ``free()``); beyond ``FakeCuda.capacity_bytes`` it raises
  ``pycuda.driver.MemoryError`` ("cuMemAlloc failed: out of memory");
  ``pagelocked_empty(shape, dtype, order="C", mem_flags=0)`` returns an ndarray
  whose ``.base`` is a ``PagelockedHostAllocation`` with ``free()``.
* ``memcpy_htod_async(dest, src, stream=None)`` /
  ``memcpy_dtoh_async(dest, src, stream=None)`` are queued on the stream and
  run, in order, at ``Stream.synchronize()`` (so code that reads results
  before synchronising gets stale bytes, as on a GPU); with ``stream=None`` or
  in ``memcpy_htod`` / ``memcpy_dtoh`` they run at once.  An async copy from
  pageable host memory is counted in ``FakeCuda.pageable_async_copies`` (the
  real one silently degrades to a synchronous copy).
* ``Stream(flags=0)`` with ``.handle`` (int), ``synchronize()``, ``is_done()``.
* Sticky errors (``FakeCuda.fault``, which the fake TensorRT's kernels call): after
  an illegal address or a launch failure every later call in that context
  fails with the same error (``cuStreamSynchronize`` too, dropping the stream's
  queued work) until the context is destroyed; pycuda raises ``LogicError`` for
  CUDA_ERROR_ILLEGAL_ADDRESS and ``LaunchError`` for CUDA_ERROR_LAUNCH_FAILED
  (``translate_cuda_error``), "<call> failed: <cuGetErrorString>".
* Host memory registration (``register_host_memory(ary, flags=0)``, pycuda's
  ``registered_host_memory`` in ``src/cpp/cuda.hpp`` and its wrapper): needs a
  current context ("explicit_context_dependent failed: invalid device context -
  no currently active context?"), a contiguous numpy array whose address and
  size are page-aligned ("cuMemHostRegister failed: invalid argument"), and no
  overlap with a live registration (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED).
  It returns a new array over the same memory whose ``.base`` is the
  ``RegisteredHostMemory`` (which keeps ``ary`` alive, so the memory cannot be
  freed while registered); ``get_device_pointer()`` works only for a
  ``mem_host_register_flags.DEVICEMAP`` registration in a context made with
  ``ctx_flags.MAP_HOST`` and not unregistered ("cuMemHostGetDevicePointer
  failed: invalid argument"); the device pointer equals the host address on an
  integrated GPU (``device_attribute.INTEGRATED``, CUDA's
  CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM), another address on a discrete one;
  device reads and writes there reach the host memory, and fault (an illegal
  address) once it is unregistered.  ``unregister()`` a second time raises
  "registered_host_memory::free failed: invalid resource handle"; after the
  context was detached it does nothing (the registration died with it, as
  pycuda's CUDAPP_CATCH_CLEANUP_ON_DEAD_CONTEXT).  Registered memory counts as
  pinned for async copies; ``FakeCuda.registrations`` holds the live ones.
* Releases (``DeviceAllocation.free``, ``PagelockedHostAllocation.free``,
  ``RegisteredHostMemory.unregister``, and the same done by the garbage
  collector, as pycuda's destructors do, also for a ``Stream``) follow pycuda's
  ``scoped_context_activation``: they work when the owner's context is current
  on the calling thread or the calling thread created it (pycuda pushes it for
  the call); after the context was detached they do nothing (the memory went
  with it); on any other thread pycuda cannot activate the context, warns
  "<type> in out-of-thread context could not be cleaned up" and the memory is
  never freed (never unregistered): a ``UserWarning`` here too, the bytes stay
  allocated (``FakeCuda.leaked_frees``) and ``FakeCuda.violations`` gets a
  sentence (``fake_tensorrt.make_stack`` forwards it to
  ``FakeTensorRT.violations``).  A second ``free()`` raises ``LogicError``
  ("...::free failed: invalid resource handle").
* The exception family: ``Error`` and its subclasses ``LogicError``,
  ``RuntimeError``, ``LaunchError``, ``MemoryError`` (the fake's
  ``MemoryError`` also derives from the builtin ``MemoryError``).

The device memory is a map of bytearrays (``FakeCuda.allocations``) that the
fake TensorRT (``tests/fakes/fake_tensorrt.py``) reads and writes through
``FakeCuda.read`` / ``FakeCuda.write`` and whose streams it enqueues work on
(``FakeCuda.enqueue``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

MIMICS = "pycuda 2024.1 (pycuda.driver); FakeCuda.version picks a later release's rules"


class Error(Exception):
    pass


class LogicError(Error):
    pass


class LaunchError(Error):
    pass


class _DriverRuntimeError(Error):
    pass


class _DriverMemoryError(Error):  # DECLARE_EXC(MemoryError, CudaError): not builtins'
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
    #: A Jetson's GPU shares the host's memory (device_attribute.INTEGRATED).
    integrated: bool = True
    #: What cuDeviceGetPCIBusId reports (a Jetson's iGPU: all zeros).
    pci_bus_id: str = "0000:00:00.0"


@dataclass
class Allocation:
    """One device allocation: its bytes and the context it belongs to."""

    address: int
    data: bytearray
    context: Any
    freed: bool = False
    #: Registered host memory (the bytes are the host's), not device memory.
    registered: bool = False


@dataclass
class FakeCuda:
    """What the fake driver reports and holds; ``calls`` records every driver call by name."""

    devices: list[FakeGpu] = field(default_factory=lambda: [FakeGpu()])
    #: ``pycuda.VERSION``.  From (2024, 1, 1) on (to 2026.1, the latest) the real
    #: ``register_host_memory`` sets its result's base twice: the registration it made
    #: is freed (so unregistered) and the call raises ``SystemError`` from a
    #: ``ValueError`` (src/wrapper/wrap_cudadrv.cpp; inducer/pycuda#459).
    version: tuple[int, ...] = (2024, 1)
    #: Where ``init`` reads CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER; None: not read.
    environ: Mapping[str, str] | None = None
    #: What CUDA numbers after ``init`` (``devices`` filtered by ``environ``).
    visible: list[FakeGpu] = field(default_factory=list)
    initialized: bool = False
    calls: list[str] = field(default_factory=list)
    #: Device memory the fake lets ``mem_alloc`` (and fake TensorRT) hand out;
    #: None means the first device's ``total_memory``.
    capacity_bytes: int | None = None
    allocations: dict[int, Allocation] = field(default_factory=dict)
    allocated_bytes: int = 0
    #: Beyond any user-space address (48-bit virtual addresses), so fake device
    #: memory can never alias host memory a registration maps at its own address.
    next_address: int = 0x0010_0000_0000_0000
    #: Per-thread context stacks, by ``threading.get_ident()``.
    stacks: dict[int, list[Any]] = field(default_factory=dict)
    contexts_created: int = 0
    contexts_detached: int = 0
    leaked_contexts: int = 0
    pushes: int = 0
    pops: int = 0
    #: Live streams by handle (the garbage collector destroys a stream, as pycuda's).
    streams: weakref.WeakValueDictionary[int, Any] = field(
        default_factory=weakref.WeakValueDictionary
    )
    streams_created: int = 0
    pagelocked_live: int = 0
    pageable_async_copies: int = 0
    #: Live host registrations by host address: (host bytes, device address, context).
    registrations: dict[int, Allocation] = field(default_factory=dict)
    #: Sticky errors by context: (exception class, cuGetErrorString text).
    sticky_errors: dict[Any, tuple[type[Error], str]] = field(default_factory=dict)
    #: pycuda rules the code under test broke, one sentence each (memory freed where
    #: pycuda cannot make its context current: a warning and a leak on the real one).
    violations: list[str] = field(default_factory=list)
    #: Also told each violation (``fake_tensorrt.make_stack`` passes its own, so a
    #: test on the fake GPU stack, or a daemon subprocess, sees them with TensorRT's).
    on_violation: Callable[[str], None] | None = None
    #: Frees pycuda could not do (out-of-thread): the memory stays allocated.
    leaked_frees: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: Per thread, what tells the fake that the thread ended (``_ThreadEnd``).
    thread_ends: threading.local = field(default_factory=threading.local, repr=False)

    # -- helpers for tests and for the fake TensorRT (not part of pycuda) -------------

    def enumerate_devices(self) -> list[FakeGpu]:
        """The devices ``cuInit`` numbers, in CUDA's order (see the module docstring)."""
        if self.environ is None:
            return list(self.devices)
        ordered = list(self.devices)
        if self.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
            ordered.sort(
                key=lambda gpu: [
                    int(part, 16) for part in gpu.pci_bus_id.replace(".", ":").split(":")
                ]
            )
        listed = self.environ.get("CUDA_VISIBLE_DEVICES")
        if listed is None:
            return ordered
        visible: list[FakeGpu] = []
        for entry in listed.split(","):
            entry = entry.strip()
            if not (entry.isascii() and entry.isdigit()) or int(entry) >= len(ordered):
                break
            visible.append(ordered[int(entry)])
        return visible

    def stack(self) -> list[Any]:
        ident = threading.get_ident()
        stack = self.stacks.get(ident)
        if stack is None:
            stack = self.stacks[ident] = []
            if threading.current_thread() is not threading.main_thread():
                self.thread_ends.watch = _ThreadEnd(self, ident, stack)
        return stack

    def current_context(self) -> Any:
        stack = self.stack()
        return stack[-1] if stack else None

    def require_context(self, what: str) -> Any:
        context = self.current_context()
        if context is None or not context._valid:
            raise LogicError(f"{what} failed: invalid device context")
        self.raise_if_faulted(context, what)
        return context

    def fault(self, context: Any, text: str, error: type[Error] | None = None) -> None:
        """A kernel in ``context`` hit a sticky error (``text`` as cuGetErrorString says it)."""
        self.sticky_errors[context] = (error or LogicError, text)

    def raise_if_faulted(self, context: Any, what: str) -> None:
        sticky = self.sticky_errors.get(context)
        if sticky is not None:
            raise sticky[0](f"{what} failed: {sticky[1]}")

    def violation(self, sentence: str) -> None:
        self.violations.append(sentence)
        if self.on_violation is not None:
            self.on_violation(sentence)

    def activate_for_release(self, context: Any, what: str) -> str:
        """How pycuda frees ``what`` of ``context`` (``scoped_context_activation`` and
        ``CUDAPP_CATCH_CLEANUP_ON_DEAD_CONTEXT`` in ``src/cpp/cuda.hpp``): ``"ok"`` when
        the context is current on this thread, or this thread created it (pycuda then
        pushes it for the call); ``"dead"`` when it was detached (nothing to free: the
        memory went with it); ``"leaked"`` otherwise: pycuda cannot activate an
        out-of-thread context, warns "<type> in out-of-thread context could not be
        cleaned up" and never frees the memory (a violation here)."""
        if context is None:
            return "ok"
        if not context._valid:
            return "dead"
        if self.current_context() is context or context._thread == threading.get_ident():
            return "ok"
        self.leaked_frees += 1
        warnings.warn(f"{what} in out-of-thread context could not be cleaned up", stacklevel=3)
        self.violation(
            f"{what} freed on a thread where its CUDA context is neither current nor its "
            "creator: pycuda cannot activate the context, so the memory is leaked"
        )
        return "leaked"

    def capacity(self) -> int:
        return (
            self.capacity_bytes
            if self.capacity_bytes is not None
            else (self.devices[0].total_memory if self.devices else 0)
        )

    def allocate(self, nbytes: int, context: Any) -> Allocation:
        with self.lock:
            if nbytes <= 0:
                raise LogicError("cuMemAlloc failed: invalid argument")
            if self.allocated_bytes + nbytes > self.capacity():
                raise _DriverMemoryError("cuMemAlloc failed: out of memory")
            address = self.next_address
            self.next_address += (nbytes + 511) // 256 * 256
            allocation = Allocation(address, bytearray(nbytes), context)
            self.allocations[address] = allocation
            self.allocated_bytes += nbytes
            return allocation

    def release(self, allocation: Allocation) -> None:
        with self.lock:
            if allocation.freed:
                raise LogicError("cuMemFree failed: invalid argument (already freed)")
            allocation.freed = True
            self.allocations.pop(allocation.address, None)
            self.allocated_bytes -= len(allocation.data)

    def resolve(self, address: int, nbytes: int, what: str) -> tuple[Allocation, int]:
        """The live allocation holding ``[address, address + nbytes)`` and the offset."""
        with self.lock:
            for allocation in self.allocations.values():
                offset = address - allocation.address
                if 0 <= offset < max(len(allocation.data), 1):
                    if offset + nbytes > len(allocation.data):
                        raise LogicError(f"{what} failed: an illegal memory access was encountered")
                    return allocation, offset
        raise LogicError(f"{what} failed: an illegal memory access was encountered")

    def register_host(self, host: int, data: memoryview, context: Any, integrated: bool) -> int:
        """Page-lock ``data`` (at host address ``host``) and map it; its device address."""
        with self.lock:
            for registered in self.registrations.values():
                other = registered.data
                if host < registered.address + len(other) and registered.address < host + len(data):
                    raise LogicError(
                        "cuMemHostRegister failed: part or all of the requested memory range "
                        "is already mapped"
                    )
            device = host
            if not integrated:
                device = self.next_address
                self.next_address += (len(data) + 4095) // 4096 * 4096 + 4096
            self.registrations[host] = Allocation(host, data, context, registered=True)
            self.allocations[device] = Allocation(device, data, context, registered=True)
            return device

    def unregister_host(self, host: int, device: int) -> None:
        with self.lock:
            self.registrations.pop(host, None)
            self.allocations.pop(device, None)

    def is_registered(self, host: int, nbytes: int) -> bool:
        with self.lock:
            return any(
                entry.address <= host and host + nbytes <= entry.address + len(entry.data)
                for entry in self.registrations.values()
            )

    def read(self, address: int, nbytes: int) -> bytes:
        allocation, offset = self.resolve(address, nbytes, "device read")
        return bytes(allocation.data[offset : offset + nbytes])

    def write(self, address: int, data: bytes) -> None:
        allocation, offset = self.resolve(address, len(data), "device write")
        allocation.data[offset : offset + len(data)] = data

    def enqueue(self, handle: int, operation: Callable[[], None], what: str) -> None:
        """Queue ``operation`` on the live stream ``handle`` of the current context."""
        context = self.require_context(what)
        stream = self.streams.get(handle)
        if stream is None:
            raise LogicError(f"{what} failed: invalid resource handle (no stream {handle:#x})")
        if stream._context is not context:
            raise LogicError(f"{what} failed: the stream belongs to another context")
        stream._pending.append(operation)


class _ThreadEnd:
    """Kept in a ``threading.local``: CPython drops it when its thread ends, as boost
    deletes the thread's pycuda ``context_stack`` (which aborts when not empty)."""

    def __init__(self, state: FakeCuda, ident: int, stack: list[Any]) -> None:
        self.state, self.ident, self.stack = state, ident, stack

    def __del__(self) -> None:
        state = self.state
        if state.stacks.get(self.ident) is self.stack:
            del state.stacks[self.ident]  # the identifier may serve a later thread
        if any(context._valid for context in self.stack):
            state.violation(
                "a thread ended with a CUDA context still pushed on pycuda's context "
                'stack: pycuda aborts the process ("The context stack was not empty upon '
                'module cleanup"); pop every context a thread pushed or made'
            )


def _is_pinned(array: Any, state: FakeCuda | None = None) -> bool:
    if (
        state is not None
        and isinstance(array, np.ndarray)
        and array.size
        and state.is_registered(array.ctypes.data, array.nbytes)
    ):
        return True
    base = array
    while base is not None:
        if type(base).__name__ == "PagelockedHostAllocation":
            return not base._freed
        base = getattr(base, "base", None)
    return False


def make_modules(state: FakeCuda) -> dict[str, types.ModuleType]:
    package = types.ModuleType("pycuda", f"fake {MIMICS} (tests/fakes/fake_pycuda.py)")
    package.__path__ = []  # a package, as the real one
    package.VERSION = state.version  # type: ignore[attr-defined]
    driver = types.ModuleType("pycuda.driver", f"fake {MIMICS}")

    class ctx_flags:  # CUctx_flags
        SCHED_AUTO = 0x00
        SCHED_SPIN = 0x01
        SCHED_YIELD = 0x02
        SCHED_BLOCKING_SYNC = 0x04
        SCHED_MASK = 0x07
        MAP_HOST = 0x08
        LMEM_RESIZE_TO_MAX = 0x10
        FLAGS_MASK = 0x1F

    class device_attribute:  # CUdevice_attribute (the ones the fake answers)
        INTEGRATED = 18
        CAN_MAP_HOST_MEMORY = 19

    class mem_host_register_flags:  # CU_MEMHOSTREGISTER_*
        PORTABLE = 0x01
        DEVICEMAP = 0x02

    def init(flags: int = 0) -> None:
        state.calls.append("init")
        if flags != 0:
            raise LogicError("cuInit failed: invalid value")
        state.visible = state.enumerate_devices()
        if not state.visible:
            raise _DriverRuntimeError("cuInit failed: no CUDA-capable device is detected")
        state.initialized = True

    class Context:
        __slots__ = ("_device", "_flags", "_thread", "_use_count", "_valid")

        def __init__(self) -> None:
            raise TypeError("pycuda._driver.Context cannot be instantiated from Python")

        @classmethod
        def _create(cls, device: Any, flags: int = 0) -> Context:
            context = object.__new__(cls)
            context._device = device
            context._flags = flags
            context._thread = threading.get_ident()
            context._use_count = 1
            context._valid = True
            return context

        @property
        def handle(self) -> int:
            return id(self)

        def push(self) -> None:
            state.calls.append("Context.push")
            if not self._valid:
                raise LogicError("cuCtxPushCurrent failed: invalid device context")
            state.stack().append(self)
            state.pushes += 1
            self._use_count += 1

        @staticmethod
        def pop() -> None:
            state.calls.append("Context.pop")
            stack = state.stack()
            if not stack:
                raise LogicError("context::pop failed: cannot pop non-current context")
            stack.pop()._use_count -= 1
            state.pops += 1

        def detach(self) -> None:
            state.calls.append("Context.detach")
            if not self._valid:
                raise LogicError("context::detach failed: cannot detach from invalid context")
            stack = state.stack()
            current = bool(stack) and stack[-1] is self
            if current:
                stack.pop()
                state.contexts_detached += 1
            elif self._thread == threading.get_ident():
                state.contexts_detached += 1
            else:
                state.leaked_contexts += 1  # pycuda: "leaked out-of-thread context"
                state.violation(
                    "a CUDA context detached on a thread where it is not current and that "
                    "did not create it: pycuda leaks it, with all its memory"
                )
            self._valid = False
            # CUDA drops the context's host registrations with it.
            for host, entry in list(state.registrations.items()):
                if entry.context is self:
                    state.registrations.pop(host)
                    for device, mapped in list(state.allocations.items()):
                        if mapped.registered and mapped.data is entry.data:
                            state.allocations.pop(device)
            # pycuda drops the now-invalid context from every stack entry it meets.
            for thread_stack in state.stacks.values():
                thread_stack[:] = [entry for entry in thread_stack if entry is not self]

        @staticmethod
        def get_current() -> Context | None:
            current = state.current_context()
            return current if current is not None and current._valid else None

        @staticmethod
        def synchronize() -> None:
            state.calls.append("Context.synchronize")
            context = state.require_context("cuCtxSynchronize")
            for stream in list(state.streams.values()):
                if stream._context is context:
                    stream.synchronize()

        @staticmethod
        def get_device() -> Any:
            return state.require_context("cuCtxGetDevice")._device

        def __repr__(self) -> str:
            return f"<pycuda._driver.Context object at {id(self):#x}>"

    class Device:
        __slots__ = ("_gpu", "_ordinal")

        def __init__(self, ordinal: int) -> None:
            state.calls.append("Device")
            if not state.initialized:
                raise LogicError("cuDeviceGet failed: initialization error")
            if not 0 <= ordinal < len(state.visible):
                raise LogicError("cuDeviceGet failed: invalid device ordinal")
            self._gpu = state.visible[ordinal]
            self._ordinal = ordinal

        @staticmethod
        def count() -> int:
            state.calls.append("Device.count")
            if not state.initialized:
                raise LogicError("cuDeviceGetCount failed: initialization error")
            return len(state.visible)

        def name(self) -> str:
            state.calls.append("Device.name")
            return self._gpu.name

        def pci_bus_id(self) -> str:
            state.calls.append("Device.pci_bus_id")
            return self._gpu.pci_bus_id

        def compute_capability(self) -> tuple[int, int]:
            state.calls.append("Device.compute_capability")
            major, minor = self._gpu.compute_capability
            return (major, minor)

        def total_memory(self) -> int:
            state.calls.append("Device.total_memory")
            return self._gpu.total_memory

        def get_attribute(self, attribute: int) -> int:
            state.calls.append("Device.get_attribute")
            if attribute == device_attribute.INTEGRATED:
                return int(self._gpu.integrated)
            if attribute == device_attribute.CAN_MAP_HOST_MEMORY:
                return 1
            raise LogicError("cuDeviceGetAttribute failed: invalid argument")

        def make_context(self, flags: int = 0) -> Context:
            state.calls.append("Device.make_context")
            context = Context._create(self, flags)
            state.stack().append(context)
            state.contexts_created += 1
            return context

    class DeviceAllocation:
        """``free()`` (and the garbage collector, as pycuda's destructor) frees it in its
        own context: see ``FakeCuda.activate_for_release``."""

        __slots__ = ("_allocation", "_valid")

        def __init__(self) -> None:
            raise TypeError("pycuda._driver.DeviceAllocation cannot be instantiated from Python")

        def __int__(self) -> int:
            return self._allocation.address

        def __index__(self) -> int:
            return self._allocation.address

        def free(self) -> None:
            state.calls.append("DeviceAllocation.free")
            if not self._valid:
                raise LogicError("device_allocation::free failed: invalid resource handle")
            self._release()

        def _release(self) -> None:
            self._valid = False
            allocation = self._allocation
            rule = state.activate_for_release(allocation.context, "device_allocation")
            if rule != "leaked" and not allocation.freed:
                state.release(allocation)

        def __del__(self) -> None:
            if getattr(self, "_valid", False):
                with contextlib.suppress(Exception):  # interpreter shutdown
                    self._release()

    class PagelockedHostAllocation(bytearray):
        """The ``.base`` of a ``pagelocked_empty`` array (a bytearray underneath so
        numpy can use it as a buffer; only ``free``/``get_flags`` are pycuda's).
        ``free()`` (and the garbage collector) frees it in its own context, as
        ``DeviceAllocation``; a second ``free()`` raises, as pycuda does."""

        __slots__ = ("_context", "_flags", "_freed")

        def free(self) -> None:
            state.calls.append("PagelockedHostAllocation.free")
            if self._freed:
                raise LogicError("pagelocked_host_allocation::free failed: invalid resource handle")
            self._release()

        def _release(self) -> None:
            self._freed = True
            if state.activate_for_release(self._context, "pagelocked_host_allocation") != (
                "leaked"
            ):
                state.pagelocked_live -= 1

        def __del__(self) -> None:
            if not getattr(self, "_freed", True):
                with contextlib.suppress(Exception):  # interpreter shutdown
                    self._release()

        def get_flags(self) -> int:
            return self._flags

    class Stream:
        """Destroyed (``cuStreamDestroy``) when the garbage collector takes it, in its
        own context, as pycuda's destructor: see ``FakeCuda.activate_for_release``."""

        __slots__ = ("__weakref__", "_context", "_handle", "_live", "_pending")

        def __init__(self, flags: int = 0) -> None:
            state.calls.append("Stream")
            self._context = state.require_context("cuStreamCreate")
            self._pending: list[Callable[[], None]] = []
            state.streams_created += 1
            self._handle = 0x5000 + state.streams_created
            state.streams[self._handle] = self
            self._live = True

        def __del__(self) -> None:
            if getattr(self, "_live", False):
                self._live = False
                with contextlib.suppress(Exception):  # interpreter shutdown
                    state.activate_for_release(self._context, "stream")

        @property
        def handle(self) -> int:
            return self._handle

        def synchronize(self) -> None:
            state.calls.append("Stream.synchronize")
            # Operations run in the stream's context, whatever is current here.
            stack = state.stack()
            stack.append(self._context)
            try:
                while self._pending:
                    state.raise_if_faulted(self._context, "cuStreamSynchronize")
                    self._pending.pop(0)()
                state.raise_if_faulted(self._context, "cuStreamSynchronize")
            except Error:
                self._pending.clear()  # a faulted context runs nothing more
                raise
            finally:
                stack.pop()

        def is_done(self) -> bool:
            return not self._pending

    class RegisteredHostMemory:
        """The ``.base`` of what ``register_host_memory`` returns (numpy builds that
        array from this object's ``__array_interface__``, which keeps it as base)."""

        __slots__ = ("_ary", "_context", "_device", "_flags", "_host", "_valid")

        def __init__(self) -> None:
            raise TypeError("pycuda._driver.RegisteredHostMemory cannot be instantiated")

        @property
        def __array_interface__(self) -> dict[str, Any]:
            return self._ary.__array_interface__  # type: ignore[no-any-return]

        def get_device_pointer(self) -> int:
            state.calls.append("RegisteredHostMemory.get_device_pointer")
            state.require_context("cuMemHostGetDevicePointer")
            if (
                not self._valid
                or not self._flags & mem_host_register_flags.DEVICEMAP
                or not self._context._flags & ctx_flags.MAP_HOST
            ):
                raise LogicError("cuMemHostGetDevicePointer failed: invalid argument")
            return int(self._device)

        def unregister(self) -> None:
            state.calls.append("RegisteredHostMemory.unregister")
            if not self._valid:
                raise LogicError("registered_host_memory::free failed: invalid resource handle")
            self._release()

        def _release(self) -> None:
            self._valid = False
            # pycuda activates the registration's own context (a dead one took the
            # registration along; an out-of-thread one cannot be activated: the memory
            # stays registered).  Like pycuda's m_base, ``ary`` stays referenced until
            # this object goes.
            if state.activate_for_release(self._context, "host_allocation") == "ok":
                state.unregister_host(self._host, self._device)

        def __del__(self) -> None:
            if getattr(self, "_valid", False):
                with contextlib.suppress(Exception):  # interpreter shutdown
                    self._release()

    def register_host_memory(ary: Any, flags: int = 0) -> np.ndarray:
        state.calls.append("register_host_memory")
        context = state.current_context()
        if context is None or not context._valid:
            raise LogicError(
                "explicit_context_dependent failed: invalid device context - no currently "
                "active context?"
            )
        if not isinstance(ary, np.ndarray):
            raise LogicError(
                "register_host_memory failed: invalid argument - ary argument is not a numpy array"
            )
        if not ary.flags.c_contiguous:
            raise LogicError(
                "register_host_memory failed: invalid argument - ary argument is not contiguous"
            )
        host, nbytes = ary.ctypes.data, ary.nbytes
        if flags & ~(mem_host_register_flags.PORTABLE | mem_host_register_flags.DEVICEMAP):
            raise LogicError("cuMemHostRegister failed: invalid argument")
        if nbytes == 0 or host % 4096 or nbytes % 4096:
            raise LogicError("cuMemHostRegister failed: invalid argument")
        view = memoryview(ary).cast("B")
        device = state.register_host(host, view, context, bool(context._device._gpu.integrated))
        if package.VERSION >= (2024, 1, 1):  # type: ignore[attr-defined]  # tests may set it
            state.unregister_host(host, device)  # the registration freed with its object
            raise SystemError(
                "<Boost.Python.function object at 0x7f0000000000> returned a result with an "
                "exception set"
            ) from ValueError("Cannot set the NumPy array 'base' dependency more than once")
        registration = object.__new__(RegisteredHostMemory)
        registration._ary = ary
        registration._context = context
        registration._device = device
        registration._flags = flags
        registration._host = host
        registration._valid = True
        return np.asarray(registration)

    for cls in (Context, Device, DeviceAllocation, PagelockedHostAllocation, Stream):
        cls.__module__ = "pycuda._driver"
    RegisteredHostMemory.__module__ = "pycuda._driver"

    def _device_address(dest: Any, what: str) -> int:
        try:
            return int(dest)
        except TypeError:
            raise TypeError(
                f"{what}: expected a device pointer, got {type(dest).__name__}"
            ) from None

    def _check_owner(address: int, nbytes: int, what: str) -> None:
        allocation, _ = state.resolve(address, nbytes, what)
        if allocation.context is not state.require_context(what):
            raise LogicError(f"{what} failed: invalid argument (memory of another context)")

    def mem_alloc(nbytes: int) -> DeviceAllocation:
        state.calls.append("mem_alloc")
        context = state.require_context("cuMemAlloc")
        handle = object.__new__(DeviceAllocation)
        handle._allocation = state.allocate(int(nbytes), context)
        handle._valid = True
        return handle

    def mem_get_info() -> tuple[int, int]:
        state.require_context("cuMemGetInfo")
        return state.capacity() - state.allocated_bytes, state.capacity()

    def pagelocked_empty(
        shape: Any, dtype: Any, order: str = "C", mem_flags: int = 0
    ) -> np.ndarray:
        state.calls.append("pagelocked_empty")
        context = state.require_context("cuMemHostAlloc")
        dtype = np.dtype(dtype)
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(dims, dtype=np.int64))
        allocation = PagelockedHostAllocation(max(count * dtype.itemsize, 1))
        allocation._context = context
        allocation._flags = mem_flags
        allocation._freed = False
        state.pagelocked_live += 1
        return np.ndarray(dims, dtype, buffer=allocation, order=order)

    def _htod(dest: Any, src: Any, what: str) -> Callable[[], None]:
        address = _device_address(dest, what)
        data = memoryview(src).cast("B")
        _check_owner(address, len(data), what)

        def copy() -> None:
            state.write(address, bytes(data))

        return copy

    def _dtoh(dest: Any, src: Any, what: str) -> Callable[[], None]:
        address = _device_address(src, what)
        view = memoryview(dest).cast("B")
        if view.readonly:
            raise TypeError(f"{what}: destination buffer is read-only")
        _check_owner(address, len(view), what)

        def copy() -> None:
            view[:] = state.read(address, len(view))

        return copy

    def memcpy_htod(dest: Any, src: Any) -> None:
        state.calls.append("memcpy_htod")
        _htod(dest, src, "cuMemcpyHtoD")()

    def memcpy_dtoh(dest: Any, src: Any) -> None:
        state.calls.append("memcpy_dtoh")
        _dtoh(dest, src, "cuMemcpyDtoH")()

    def memcpy_htod_async(dest: Any, src: Any, stream: Stream | None = None) -> None:
        state.calls.append("memcpy_htod_async")
        if not _is_pinned(src, state):
            state.pageable_async_copies += 1
        copy = _htod(dest, src, "cuMemcpyHtoDAsync")
        if stream is None:
            copy()
        else:
            state.enqueue(stream.handle, copy, "cuMemcpyHtoDAsync")

    def memcpy_dtoh_async(dest: Any, src: Any, stream: Stream | None = None) -> None:
        state.calls.append("memcpy_dtoh_async")
        if not _is_pinned(dest, state):
            state.pageable_async_copies += 1
        copy = _dtoh(dest, src, "cuMemcpyDtoHAsync")
        if stream is None:
            copy()
        else:
            state.enqueue(stream.handle, copy, "cuMemcpyDtoHAsync")

    exported: dict[str, Any] = {
        "init": init,
        "Device": Device,
        "Context": Context,
        "DeviceAllocation": DeviceAllocation,
        "PagelockedHostAllocation": PagelockedHostAllocation,
        "HostAllocation": PagelockedHostAllocation,
        "Stream": Stream,
        "RegisteredHostMemory": RegisteredHostMemory,
        "register_host_memory": register_host_memory,
        "ctx_flags": ctx_flags,
        "device_attribute": device_attribute,
        "mem_host_register_flags": mem_host_register_flags,
        "mem_alloc": mem_alloc,
        "mem_get_info": mem_get_info,
        "pagelocked_empty": pagelocked_empty,
        "memcpy_htod": memcpy_htod,
        "memcpy_dtoh": memcpy_dtoh,
        "memcpy_htod_async": memcpy_htod_async,
        "memcpy_dtoh_async": memcpy_dtoh_async,
        "Error": Error,
        "LogicError": LogicError,
        "LaunchError": LaunchError,
        "RuntimeError": _DriverRuntimeError,
        "MemoryError": _DriverMemoryError,
    }
    for name, value in exported.items():
        setattr(driver, name, value)
    package.driver = driver  # type: ignore[attr-defined]
    return {"pycuda": package, "pycuda.driver": driver}


def install(monkeypatch: pytest.MonkeyPatch, state: FakeCuda) -> FakeCuda:
    for name, module in make_modules(state).items():
        monkeypatch.setitem(sys.modules, name, module)
    return state
