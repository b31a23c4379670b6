"""Client shared-memory regions registered with CUDA for one ``tensorrt`` runtime.

``pycuda.driver.register_host_memory(ary, flags)`` page-locks the pages of
``ary`` (whose address and size must be page-aligned: a region's whole mapping
is) and, with ``mem_host_register_flags.DEVICEMAP`` in a context made with
``ctx_flags.MAP_HOST``, maps them into the device's address space; the
returned array's ``.base`` is the ``RegisteredHostMemory``, whose
``get_device_pointer()`` gives that address and which holds ``ary`` (so the
memory cannot go while it is registered).  On a Jetson (integrated GPU, one
DRAM) TensorRT then reads its inputs from and writes its outputs to the
client's memory at that address; on a discrete GPU the copies between the
engine's device buffers and the client's now page-locked memory are DMA
straight from and to it, with no staging copy through the runtime's own
pinned buffers.

A region is registered the first time a request of this runtime uses it,
inside the runtime's CUDA section, and unregistered
(``RegisteredHostMemory.unregister``, with the runtime's context current and
its lock held, so never under a running inference) in the release hook the
region runs before it is unmapped, or when the runtime closes (before its
context is detached), whichever comes first.  Dropping the registered array
then lets the region's memory be unmapped.  Registrations are keyed by the
region object; the hook holds the runtime's registrations weakly, so a region
never keeps a replaced runtime alive.

pycuda from 2024.1.1 on (to 2026.1, the latest) cannot register: see
``REGISTRATION_BROKEN_SINCE``.  With such a pycuda, or any ``register_host_memory``
that fails other than with ``cuda.Error``, a region's tensors go through the
runtime's own buffers, as a tensor in no region does (a copy each way), and
``shm_cuda_registration_unavailable`` says so once a runtime.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from inferd.errors import InferenceError
from inferd.types import HostRegion

if TYPE_CHECKING:
    from inferd.runtime.tensorrt_cuda import CudaContext

log = structlog.get_logger("inferd.runtime.tensorrt")

#: ``pycuda.VERSION`` from which ``register_host_memory`` fails every call: it builds
#: the returned array with ``PyArray_FromInterface``, which has set its base already,
#: then sets the base again, which fails; numpy frees the registration it was handed,
#: and pycuda then touches it and frees it once more before raising ``SystemError``
#: (``src/wrapper/wrap_cudadrv.cpp``; inducer/pycuda#459; its own test of the call is
#: an expected failure since 2024-07).  The daemon never calls it on those releases.
REGISTRATION_BROKEN_SINCE = (2024, 1, 1)


def registration_works(version: object) -> bool:
    """Whether a pycuda of ``version`` (``pycuda.VERSION``; anything else: not known)
    registers host memory."""
    known = isinstance(version, tuple) and all(isinstance(part, int) for part in version)
    return known and version < REGISTRATION_BROKEN_SINCE  # type: ignore[operator]


@dataclass
class _Registration:
    #: What register_host_memory returned (its ``.base`` is the RegisteredHostMemory).
    registered: Any
    host_address: int
    nbytes: int
    device_address: int


class HostRegistrations:
    """The regions one runtime registered with its CUDA context."""

    def __init__(self, cuda: CudaContext) -> None:
        self._cuda = cuda
        self._by_region: dict[int, tuple[HostRegion, _Registration]] = {}
        #: The pycuda in use, and why no region is registered (None: they are).
        self._version = getattr(sys.modules.get("pycuda"), "VERSION", None)
        self.unavailable: str | None = None
        if not registration_works(self._version):
            self.unavailable = (
                f"pycuda {self._version} cannot register host memory "
                f"(releases from {REGISTRATION_BROKEN_SINCE} fail every call; inducer/pycuda#459)"
            )
        self._said = False

    def __len__(self) -> int:
        return len(self._by_region)

    def device_address(self, array: np.ndarray, regions: Sequence[HostRegion]) -> int | None:
        """The device address of ``array`` when it lies in one of ``regions`` (which
        is registered on first use), else None.  Inside the runtime's CUDA section."""
        if not regions or not array.size or not array.flags.c_contiguous:
            return None  # a strided view's bytes are not the nbytes from its address
        if self.unavailable is not None:
            self._say_unavailable()
            return None  # through the runtime's buffers
        start = int(array.ctypes.data)
        end = start + array.nbytes
        for region in regions:
            registration = self._registration(region)
            if registration is None:
                return None
            base = registration.host_address
            if base <= start and end <= base + registration.nbytes:
                return registration.device_address + (start - base)
        return None

    def _say_unavailable(self) -> None:
        if not self._said:
            self._said = True
            log.warning(
                "shm_cuda_registration_unavailable",
                pycuda_version=str(self._version),
                reason=self.unavailable,
                integrated=self._cuda.integrated,
            )

    def _registration(self, region: HostRegion) -> _Registration | None:
        """The region's registration, made now if it has none; None when pycuda
        cannot register (``unavailable`` says why from then on)."""
        entry = self._by_region.get(id(region))
        if entry is not None:
            return entry[1]
        cuda = self._cuda.module
        host = region.host_array()
        try:
            registered = cuda.register_host_memory(host, cuda.mem_host_register_flags.DEVICEMAP)
        except cuda.Error as exc:
            raise InferenceError(f"cannot register a shared region with CUDA: {exc}") from exc
        except Exception as exc:  # the library's fault, not the region's: never again here
            self.unavailable = f"register_host_memory failed: {type(exc).__name__}: {exc}"
            self._say_unavailable()
            return None
        try:
            device = int(registered.base.get_device_pointer())
        except cuda.Error as exc:
            registered.base.unregister()
            raise InferenceError(f"cannot map a shared-memory region into the GPU: {exc}") from exc
        registration = _Registration(registered, int(host.ctypes.data), host.nbytes, device)
        self._by_region[id(region)] = (region, registration)
        owner = weakref.ref(self)

        def release() -> None:
            registrations = owner()
            if registrations is not None:
                registrations.release(region)

        region.on_release(release)
        log.info(
            "shm_region_registered_with_cuda", nbytes=host.nbytes, in_place=self._cuda.integrated
        )
        return registration

    def release(self, region: HostRegion) -> None:
        """Unregister ``region`` (its release hook: any thread, no request uses it)."""
        with self._cuda.lock:
            entry = self._by_region.pop(id(region), None)
            if entry is None or self._cuda.context is None:
                return  # never registered, or closed (everything was unregistered then)
            with self._cuda.section():
                _unregister(self._cuda, entry[1])

    def close(self) -> None:
        """Unregister everything (the runtime closes; its context is current)."""
        while self._by_region:
            _, (_, registration) = self._by_region.popitem()
            _unregister(self._cuda, registration)


def _unregister(cuda: CudaContext, registration: _Registration) -> None:
    try:
        registration.registered.base.unregister()
    except cuda.module.Error as exc:  # logged; the array is dropped all the same
        log.error("cuda_host_unregister_failed", error=str(exc))
    finally:
        registration.registered = None
