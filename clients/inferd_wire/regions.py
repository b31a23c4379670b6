"""The wire contract of shared-memory tensors, shared by the daemon and its clients.

A client hands the daemon a region of memory once, over the shm socket
(``shm.sock``, a local ``SOCK_SEQPACKET`` Unix socket next to the infer
socket): a small msgpack header and, with ``register``, a sealed memfd passed
with ``SCM_RIGHTS``.  The daemon answers with the region's id, 128 random bits
as 32 hex digits: a capability the client then names in infer requests, where
a tensor descriptor may carry ``region``, ``offset`` and ``nbytes`` instead of
a frame (inputs), or name where an output is to be written (``outputs``).  A
request whose every tensor lives in a region may itself be sent on the shm
socket (``infer``): one message each way.

Only standard library code lives here (no sockets), so both sides import it
freely; the JSON Schemas ``schemas/bus/shm_request.json``, ``shm_reply.json``
and ``common.json#/$defs/region_tensor_descriptor`` are the normative text.
"""

from __future__ import annotations

import contextlib
import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferd_wire.protocol import Code, ProtocolError, require_text

#: File name of the shm socket, in the infer socket's directory.
SHM_SOCKET_NAME = "shm.sock"
#: Upper bound of one message on the shm socket, either way (a header only; a
#: memfd travels as ancillary data): room for an infer request or reply naming
#: ``MAX_REGION_TENSORS`` tensors.  Larger messages are refused.
MAX_SHM_MESSAGE_BYTES = 16384
#: Every region-backed tensor starts at a multiple of this: what TensorRT asks of
#: a tensor address (256 bytes), and more than any dtype or ONNX Runtime needs.
REGION_ALIGNMENT = 256
#: Region-backed tensors (inputs and outputs) one request may name, as
#: ``bus.max_frames`` bounds its frames: the checks of a request stay cheap.
MAX_REGION_TENSORS = 64
#: Where Linux says whether shared memory (a memfd) may use transparent huge
#: pages: ``advise`` (or ``always``, ``within_size``, ``force``) for a mapping
#: that asks (``advise_huge_pages``); Linux's default is ``never``.
SHMEM_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def region_size_problem(size: int) -> str | None:
    """Why a memfd of ``size`` bytes cannot be a region, or None when it can: a
    region is a positive multiple of the page size (what both sides map and CUDA
    registers)."""
    if size <= 0 or size % mmap.PAGESIZE:
        return (
            f"the memfd holds {size} bytes; a region must be a positive multiple of the "
            f"page size ({mmap.PAGESIZE})"
        )
    return None


def advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for transparent huge pages on a region's mapping (``MADV_HUGEPAGE``),
    advice a kernel without THP may ignore or refuse.  Both sides ask: the
    side that first touches a page decides its size, and a page of 2 MiB is
    mapped as one by a mapping that asked.  A 25 MB tensor copied between 4 KiB
    pages took 2.5-2.7 ms on the 2-vCPU VM, between huge pages 1.9-2.0 ms (the
    TLB; DESIGN.md 118).  Effective where ``SHMEM_HUGE_PAGES`` allows it."""
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE, or no THP
        mapping.madvise(mmap.MADV_HUGEPAGE)


def shmem_huge_pages() -> str:
    """The kernel's shmem huge-page policy (``SHMEM_HUGE_PAGES``'s selected word),
    or ``unavailable`` where the file is missing or unreadable."""
    try:
        text = SHMEM_HUGE_PAGES.read_text()
    except OSError:
        return "unavailable"
    chosen = re.search(r"\[(\w+)\]", text)
    return chosen.group(1) if chosen else text.strip()


#: Hex digits of a region id (128 bits).
REGION_ID_HEX = 32
#: Longest ``label`` a client may give a region (shown in ``status``), in
#: characters and in bytes of UTF-8: characters alone let a label take 256 bytes,
#: four times what ``status`` budgets for it (DESIGN.md 295).
MAX_LABEL_CHARS = 64
MAX_LABEL_BYTES = 64
#: How much of a region id ``status`` and the logs show: enough to tell regions
#: apart, far too little to use one (the id is the capability).
REGION_ID_SHOWN = 8
#: Registration operations of the shm socket (which serves ``infer`` too).
SHM_OPS = ("register", "unregister")

_REGION_ID = re.compile(r"[0-9a-f]{32}")
_MAX_OFFSET = 2**63


@dataclass(frozen=True)
class RegionRef:
    """Where a tensor lives: ``nbytes`` bytes at ``offset`` in region ``region``."""

    region: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def as_wire(self) -> dict[str, Any]:
        return {"region": self.region, "offset": self.offset, "nbytes": self.nbytes}


def shown(region_id: str) -> str:
    """The part of a region id that status and log lines show."""
    return region_id[:REGION_ID_SHOWN]


def is_region_id(value: str) -> bool:
    return _REGION_ID.fullmatch(value) is not None


def parse_region_id(value: Any) -> str:
    """A well-formed region id (32 lowercase hex digits), or INVALID_ARGUMENT."""
    if not isinstance(value, str) or _REGION_ID.fullmatch(value) is None:
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"'region' must be {REGION_ID_HEX} lowercase hex digits"
        )
    return value


def parse_region_ref(where: str, descriptor: dict[str, Any]) -> RegionRef | None:
    """The ``region``/``offset``/``nbytes`` of a tensor descriptor, or None when it
    names no region (then neither ``offset`` nor ``nbytes`` may be present).
    ``offset`` must be a multiple of ``REGION_ALIGNMENT``; that the range lies
    within the region is checked by the daemon, which knows the region's size."""
    if "region" not in descriptor:
        stray = [key for key in ("offset", "nbytes") if key in descriptor]
        if stray:
            raise ProtocolError(Code.INVALID_ARGUMENT, f"{where}: {stray} given without a 'region'")
        return None
    region = parse_region_id(descriptor["region"])
    values = []
    for key in ("offset", "nbytes"):
        value = descriptor.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_OFFSET:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"{where}: '{key}' must be a non-negative integer below 2**63, got {value!r}",
            )
        values.append(value)
    offset, nbytes = values
    if offset % REGION_ALIGNMENT:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"{where}: offset {offset} is not a multiple of {REGION_ALIGNMENT} "
            "(region-backed tensors are 256-byte aligned)",
        )
    return RegionRef(region, offset, nbytes)


def parse_label(value: Any) -> str | None:
    """A registration's optional ``label``: 1..64 printable characters, at most 64
    bytes of UTF-8 (it is shown in ``status`` and the logs)."""
    if value is None:
        return None
    label = require_text(value, "label", MAX_LABEL_CHARS)
    if (size := len(label.encode())) > MAX_LABEL_BYTES:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"'label' must be at most {MAX_LABEL_BYTES} bytes of UTF-8; this one is {size}",
        )
    return label


def shm_socket_path(infer_endpoint: str, runtime_dir: Path) -> Path:
    """Where the shm socket is: next to an ``ipc://`` infer socket, else
    in ``runtime_dir``.  The daemon binds it there and clients look for it there."""
    if infer_endpoint.startswith("ipc://"):
        return Path(infer_endpoint.removeprefix("ipc://")).parent / SHM_SOCKET_NAME
    return runtime_dir / SHM_SOCKET_NAME
