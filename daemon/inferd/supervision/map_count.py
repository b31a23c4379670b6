"""The kernel's bound on a process's memory mappings (``vm.max_map_count``).

Every region a client registers on ``shm.sock`` is one mapping of its memfd in
the daemon (``shm.memfd``), beside what the process maps itself: its libraries,
ORT's and CUDA's, thread stacks, malloc's large blocks.  Past the sysctl's count
every ``mmap`` fails with ``ENOMEM``: a region's registration is then refused
(RESOURCE_EXHAUSTED), but so is a thread's stack, malloc's next large block or a
CUDA allocation, and some of those abort the process.  The sysctl is the same
for every process (65,530 by default), far above what the default bounds need
(256 regions); the daemon refuses to start only when its shm bounds, what it
maps already and a reserve cannot fit under it, as it refuses a descriptor limit
too low for its bounds (``supervision.open_files``): clients within every bound
could otherwise take the mappings the daemon itself needs.  With ``[shm]`` off no
client can make it map anything: a sysctl below what it maps and the reserve is
then logged (``map_count_low``, WARNING) and the daemon starts.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from inferd.config import ShmConfig
from inferd.errors import MapCountLimitError

log = structlog.get_logger("inferd.supervision")

MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
SELF_MAPS = Path("/proc/self/maps")
#: Mappings the process makes after the check besides the regions: the models'
#: sessions (the demo model on ORT's CPU provider: ~100), CUDA's and TensorRT's
#: libraries and allocations, thread stacks (two each), malloc's arenas and its
#: blocks past ``M_MMAP_THRESHOLD`` (a queued request's large tensors), closed
#: regions the registration thread has yet to unmap.  A quarter of the default
#: sysctl: it costs nothing under 65,530, and leaves the regions ~48,000 there.
RESERVED_MAPPINGS = 16384

#: What to change when the mappings do not fit, in the refusal and its log event.
RAISE_SYSCTL = "raise vm.max_map_count (sysctl -w, and a file in /etc/sysctl.d/ to keep it)"
CHANGE = f"{RAISE_SYSCTL}, or lower shm.max_connections or shm.max_regions_per_connection"


def shm_mappings(shm: ShmConfig) -> int:
    """The most mappings ``shm.sock``'s clients can make the daemon hold: a region
    each (``max_connections`` x ``max_regions_per_connection`` in all, the regions
    of closed connections that queued requests still lease included), and the one
    a registration maps before its bounds are checked again under the table's lock
    (registrations are read one at a time, under the bus's handler lock)."""
    if not shm.enabled:
        return 0
    return shm.max_connections * shm.max_regions_per_connection + 1


def mappings_needed(shm: ShmConfig) -> int:
    """What the process may map after start: the shm socket's and the reserve."""
    return shm_mappings(shm) + RESERVED_MAPPINGS


def check_map_count(
    shm: ShmConfig, max_map_count: int | None = None, mapped: int | None = None
) -> int | None:
    """The mappings left once the bounds and the reserve are taken from
    ``max_map_count`` (the sysctl's value) and ``mapped`` (the process's mappings
    now), both read from ``/proc`` when None.  ``MapCountLimitError`` (logged
    ``map_count_low``) when they do not fit and shm is on (off: only logged); None
    (logged ``map_count_unknown``) when ``/proc`` cannot tell, and the daemon starts
    unchecked."""
    try:
        if max_map_count is None:
            max_map_count = int(MAX_MAP_COUNT.read_text())
        if mapped is None:
            with SELF_MAPS.open("rb") as maps:
                mapped = sum(1 for _line in maps)
    except (OSError, ValueError) as exc:  # no /proc, or no /proc/sys in a sandbox
        log.warning("map_count_unknown", error=str(exc))
        return None
    needed = mappings_needed(shm)
    left = max_map_count - mapped - needed
    if left < 0 and not shm.enabled:
        # No client can make the daemon map anything: the host's setting, said, not refused.
        log.warning(
            "map_count_low", limit=max_map_count, mapped=mapped, needed=needed, hint=RAISE_SYSCTL
        )
        return left
    if left < 0:
        log.error("map_count_low", limit=max_map_count, mapped=mapped, needed=needed, hint=CHANGE)
        raise MapCountLimitError(
            f"the kernel's limit on a process's memory mappings (vm.max_map_count) is "
            f"{max_map_count}, below the {mapped + needed} the config's bounds need "
            f"({_regions(shm)}, {mapped} the daemon maps at start, a reserve of "
            f"{RESERVED_MAPPINGS}): {CHANGE}",
            limit=max_map_count,
            needed=mapped + needed,
        )
    log.info("map_count", limit=max_map_count, mapped=mapped, needed=needed)
    return left


def _regions(shm: ShmConfig) -> str:
    return (
        f"{shm_mappings(shm)} for shm.sock's regions: shm.max_connections "
        f"{shm.max_connections} x shm.max_regions_per_connection "
        f"{shm.max_regions_per_connection} and one being registered"
    )
