"""One mapped region and the registration connection that owns it (``regions``
explains their life: registered, leased by requests, released, unmapped).

Unmapping runs the runtimes' release hooks (TensorRT drops its CUDA
registration), then drops the tensor views it kept for repeated requests and the
one numpy view of the whole mapping that every tensor view is a slice of, then
closes the mapping.  Python refuses to close a mapping while any buffer exported
from it is alive (``BufferError``), so a tensor view that outlived its lease can
never point into unmapped memory: the region then stays mapped (and counted) and
the close is retried.
"""

from __future__ import annotations

import mmap
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from inferd.shm.credentials import PeerCredentials
from inferd_wire.protocol import Code, ProtocolError
from inferd_wire.regions import RegionRef, shown

log = structlog.get_logger("inferd.shm")

#: Region ids a connection remembers having unregistered (for a clear "already
#: unregistered" instead of "unknown").
_REMEMBERED_UNREGISTERED = 64
#: Tensor views a region keeps for the next request (a few per camera loop).
_MAX_VIEWS = 32


@dataclass
class Connection:
    """One registration connection and the regions it registered."""

    connection_id: int
    peer: PeerCredentials
    regions: dict[str, Region] = field(default_factory=dict)
    #: Its regions, and those it released that are still mapped (leased, or not
    #: yet unmapped): what ``shm.max_regions_per_connection`` bounds.
    held: int = 0
    #: Gone (``RegionTable.disconnect``): it registers nothing more.
    closed: bool = False
    unregistered: deque[str] = field(default_factory=lambda: deque(maxlen=_REMEMBERED_UNREGISTERED))


class Region:
    """One mapped memfd (see the module docstring)."""

    def __init__(
        self,
        region_id: str,
        connection: Connection,
        mapping: mmap.mmap,
        size: int,
        label: str | None,
    ) -> None:
        self.region_id = region_id
        self.connection = connection
        self.owner = connection.peer
        self.size = size
        self.label = label
        self.created_unix_s = time.time()
        self.leases = 0
        #: Unregistered, or its connection gone: no new lease; unmapped at 0 leases.
        self.closing = False
        self.unmap_failed = False
        self._mapping = mapping
        self._base: np.ndarray | None = np.frombuffer(mapping, np.uint8)
        #: The tensor views handed out (``view``), dropped when it is unmapped.
        self._views: dict[tuple[Any, ...], np.ndarray] = {}
        self._hooks: list[Callable[[], None]] = []

    @property
    def shown_id(self) -> str:
        return shown(self.region_id)

    # -- HostRegion (inferd.types) ------------------------------------------------
    def host_array(self) -> np.ndarray:
        if self._base is None:
            raise RuntimeError(f"region {self.shown_id} is unmapped")
        return self._base

    def on_release(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)

    # -- tensors ------------------------------------------------------------------
    def check_range(self, where: str, ref: RegionRef) -> None:
        if ref.end > self.size:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"{where}: bytes {ref.offset}..{ref.end} lie outside region {self.shown_id} "
                f"of {self.size} bytes",
            )

    def view(
        self, ref: RegionRef, dtype: np.dtype[Any], shape: tuple[int, ...], *, writeable: bool
    ) -> np.ndarray:
        """``ref``'s bytes as an array (a slice of the one view of the mapping): the
        same array for the same bytes, dtype, shape and ``writeable`` until the
        region is unmapped, since a camera loop's requests view the same bytes
        every time (DESIGN.md 109)."""
        key = (ref.offset, ref.nbytes, dtype, shape, writeable)
        array = self._views.get(key)
        if array is None:
            array = self.host_array()[ref.offset : ref.end].view(dtype).reshape(shape)
            array.flags.writeable = writeable
            if len(self._views) >= _MAX_VIEWS:
                self._views = {}  # rebound, not cleared: another thread may be reading it
            self._views[key] = array
        return array

    # -- release ------------------------------------------------------------------
    def unmap(self) -> bool:
        """Run the release hooks (once), then unmap; False while a view is alive."""
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:  # a runtime's failure must not keep the memory mapped
                log.exception("shm_release_hook_failed", region=self.shown_id)
        self._views = {}
        self._base = None
        try:
            self._mapping.close()
        except BufferError:
            self._base = np.frombuffer(self._mapping, np.uint8)
            return False
        return True
