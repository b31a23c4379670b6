"""``SharedRegion``: a sealed memfd and its mapping, handing out numpy arrays backed
by it (``region.array(shape, dtype)``): allocate once, fill in place (a camera
driver can write straight into one), infer, read the outputs in place.  The
daemon maps the same memfd once it is registered (``InferenceClient.register_region``
or ``shared_region``), so no tensor byte crosses a socket."""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import operator
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from inferd_client.errors import ClientError, InvalidArgument
from inferd_wire.regions import REGION_ALIGNMENT, advise_huge_pages, region_size_problem

#: Sealed against shrinking (what the daemon requires: it can then never fault on
#: the memory), growing, and further sealing.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Seals that forbid writing through a shared mapping (``F_SEAL_FUTURE_WRITE``:
#: Linux 5.1, ``include/uapi/linux/fcntl.h``; not exported by Python's ``fcntl``).
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


class SharedRegion:
    """A sealed memfd of ``nbytes`` (rounded up to the page size), mapped read-write.

    ``array`` allocates C-contiguous arrays in it, each at a 256-byte aligned
    offset; ``locate`` says where an array lives in it.  ``close`` releases the
    mapping once no array of it is alive (the daemon's own mapping, if
    registered, is released when the registration is)."""

    def __init__(self, nbytes: int, *, label: str | None = None) -> None:
        if nbytes <= 0:
            raise InvalidArgument(f"a region needs a positive size, got {nbytes}")
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create(f"inferd-{label or 'region'}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(fd)
            raise
        self._open(fd, size, label)

    @classmethod
    def adopt(cls, fd: int, *, label: str | None = None) -> SharedRegion:
        """A region over a memfd made elsewhere (a camera service's frame buffer,
        handed over with ``SCM_RIGHTS``), which the region then owns and closes.

        It must be a memfd open read-write, not sealed against writing, whose size
        is a positive multiple of the page size, and either sealed against
        shrinking or still sealable: then it is sealed here against shrinking,
        growing and further sealing, as ``SharedRegion(n)`` seals its own.
        Anything else is refused (``ClientError``, ``fd`` closed) before a seal is
        added, so a refused memfd is left to its maker as it came."""
        try:
            size = _seal_for_adoption(fd)
        except BaseException:
            with contextlib.suppress(OSError):  # not a descriptor at all: nothing to close
                os.close(fd)
            raise
        region = cls.__new__(cls)
        region._open(fd, size, label)
        return region

    def _open(self, fd: int, size: int, label: str | None) -> None:
        """Map ``fd`` (sealed, ``size`` bytes), which the region owns from now on."""
        try:
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except OSError as exc:
            os.close(fd)
            raise ClientError(f"the memfd cannot be mapped read-write: {exc.strerror}") from None
        advise_huge_pages(mapping)
        self.nbytes, self.label, self.fd, self._mapping = size, label, fd, mapping
        self._base: np.ndarray | None = np.frombuffer(self._mapping, np.uint8)
        # The mapping never moves: its address is read once (``ctypes.data``
        # costs microseconds, and ``locate`` runs per tensor per request).
        self._address: int = self._base.__array_interface__["data"][0]
        self._used = 0

    @property
    def is_open(self) -> bool:
        return self._base is not None

    @property
    def address(self) -> int:
        self._view()
        return self._address

    def _view(self) -> np.ndarray:
        if self._base is None:
            raise ClientError("the shared region is closed")
        return self._base

    def array(self, shape: Sequence[int] | int, dtype: Any) -> np.ndarray:
        """A new writable array in the region (its contents are whatever was there)."""
        try:
            try:
                dims: tuple[int, ...] = (operator.index(shape),)  # type: ignore[arg-type]
            except TypeError:
                dims = tuple(operator.index(dim) for dim in shape)  # type: ignore[union-attr]
            dtype = np.dtype(dtype)
        except TypeError as exc:
            raise InvalidArgument(
                f"an array of shape {shape!r} and dtype {dtype!r}: {exc}"
            ) from None
        if any(dim < 0 for dim in dims):
            raise InvalidArgument(f"an array of shape {list(dims)}: a dimension is negative")
        if dtype.hasobject or dtype.itemsize == 0:
            raise InvalidArgument(f"an array of {dtype} cannot live in shared memory")
        nbytes = math.prod(dims) * dtype.itemsize
        offset = -(-self._used // REGION_ALIGNMENT) * REGION_ALIGNMENT
        if offset + nbytes > self.nbytes:
            raise ClientError(
                f"the region has {self.nbytes - offset} bytes left; an array of {list(dims)} "
                f"{dtype.name} needs {nbytes}"
            )
        view: np.ndarray = self._view()[offset : offset + nbytes].view(dtype).reshape(dims)
        self._used = offset + nbytes  # only once the array is made: a refused one takes nothing
        return view

    def reset(self) -> None:
        """Allocate from the start again (arrays handed out before now alias new ones)."""
        self._used = 0

    def locate(self, array: np.ndarray) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of ``array`` when it is a C-contiguous, 256-byte aligned
        block of this region, else None (it then travels as a frame)."""
        if self._base is None or not array.flags.c_contiguous:
            return None
        start = array.__array_interface__["data"][0] - self._address
        if start < 0 or start + array.nbytes > self.nbytes or start % REGION_ALIGNMENT:
            return None
        return start, array.nbytes

    def close(self) -> None:
        """Unmap (once no array of the region is alive) and close the memfd."""
        self._base = None
        with contextlib.suppress(BufferError):  # arrays still alive keep it until they go
            self._mapping.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        # Dropped unclosed: the memfd, and so every page of the region, would stay
        # for as long as the process (the mapping holds a descriptor of its own,
        # closed with it once no array of the region is alive).
        fd = getattr(self, "fd", -1)  # not there when __init__ failed
        if fd >= 0:
            self.fd = -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _seal_for_adoption(fd: int) -> int:
    """The size of ``fd``, a memfd ``SharedRegion.adopt`` may take, once sealed
    against shrinking; ``ClientError`` with the reason otherwise.  Seals belong to
    the memfd, not to this descriptor, and cannot be taken back: every check that
    can refuse it comes first."""
    if fd < 0:
        raise ClientError(f"descriptor {fd} cannot be a region: it is not a descriptor")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise ClientError(
            f"descriptor {fd} cannot be a region ({exc.strerror}): it must be a memfd"
        ) from None
    if access != os.O_RDWR:
        raise ClientError(
            f"descriptor {fd} is not open read-write: outputs are written into regions"
        )
    if seals & _WRITE_SEALS:
        raise ClientError(
            f"the memfd is sealed against writing (seals {seals:#x}): outputs are written "
            "into regions"
        )
    problem = region_size_problem(size)
    if problem is not None:
        raise ClientError(problem)
    if seals & fcntl.F_SEAL_SHRINK:
        return size
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as exc:
        raise ClientError(
            f"the memfd cannot be sealed against shrinking ({exc.strerror}): it must be "
            "created with MFD_ALLOW_SEALING and not sealed with F_SEAL_SEAL"
        ) from None
    # Its maker may have resized it between the check and the seal; now it cannot.
    size = os.fstat(fd).st_size
    problem = region_size_problem(size)
    if problem is not None:
        raise ClientError(problem)
    return size
