"""The process's limit on open descriptors (``RLIMIT_NOFILE``).

Every connection to the daemon's sockets is a descriptor, and libzmq aborts the
process when an ``ipc://`` accept fails for want of one (``EMFILE`` is not among
the errors its listener tolerates).  systemd starts services with a soft limit
of 1024 for the sake of ``select(2)``, which the daemon does not use, and
``systemd/inferd.service`` sets ``LimitNOFILE=65536``; the daemon raises its soft
limit to the hard one at start, and refuses to start when that leaves too little
room for ``bus.max_connections`` on its three ZeroMQ sockets (DESIGN.md 128) and
for what ``shm.sock``'s clients can make it hold (``shm_descriptors``): clients
within every configured bound could then make libzmq abort it.
"""

from __future__ import annotations

import resource

import structlog

from inferd.config import ShmConfig
from inferd.errors import OpenFilesLimitError
from inferd.shm.closer import MAX_WAITING

log = structlog.get_logger("inferd.supervision")

#: Descriptors the daemon holds besides its sockets' connections and the shm
#: socket's (``shm_descriptors``): recorder segments, engines, models, build
#: children's pipes (two per running build, one build per model), the metrics
#: server, ZeroMQ's own (its I/O threads' and the inproc pairs').
RESERVED_DESCRIPTORS = 1024
#: The shm socket's own: its listener, the registration thread's selector and
#: wake-up pair, the connections' epoll set, and the copy of a descriptor a
#: message brings that ``shm.messages`` peeks at.
SHM_OWN_DESCRIPTORS = 5
#: The most descriptors one ``shm.sock`` message brings (Linux's ``SCM_MAX_FD``):
#: ``shm.messages`` reads each message with room for all of them.
SCM_MAX_FD = 253


def shm_descriptors(shm: ShmConfig) -> int:
    """The most descriptors ``shm.sock``'s clients can make the daemon hold: its own,
    a socket per connection, a mapping's duplicate of its memfd per region
    (``max_connections`` x ``max_regions_per_connection`` in all, the regions of
    closed connections that queued requests still lease included: CPython's
    ``mmap.mmap(fd)`` keeps a ``dup`` of the descriptor while it maps), and what
    waits to be closed (``shm.closer``: twice its bound and one message's)."""
    if not shm.enabled:
        return 0
    regions = shm.max_connections * shm.max_regions_per_connection
    closing = 2 * MAX_WAITING + SCM_MAX_FD
    return SHM_OWN_DESCRIPTORS + shm.max_connections + regions + closing


def descriptors_needed(max_connections: int, shm: ShmConfig) -> int:
    """Three ZeroMQ sockets of ``max_connections`` (one peer's), the shm socket's
    (``shm_descriptors``) and the reserve."""
    return 3 * max_connections + shm_descriptors(shm) + RESERVED_DESCRIPTORS


#: What to change when the limit is too low, in the refusal and its log event.
CHANGE = (
    "raise LimitNOFILE= in the unit (the hard limit, ulimit -Hn, where inferd runs by hand), "
    "or lower bus.max_connections, shm.max_connections or shm.max_regions_per_connection"
)


def raise_open_files_limit(max_connections: int, shm: ShmConfig) -> int:
    """Raise the soft limit to the hard one; the limit now.  ``OpenFilesLimitError``
    (logged ``open_files_limit_low``) when three sockets of ``max_connections`` each,
    what ``shm`` lets clients hold and the reserve do not fit (``descriptors_needed``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a container's nr_open below the hard limit
            log.warning("open_files_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    needed = descriptors_needed(max_connections, shm)
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.error("open_files_limit_low", limit=soft, needed=needed, hint=CHANGE)
        raise OpenFilesLimitError(
            f"the limit on open descriptors (RLIMIT_NOFILE) is {soft}, below the {needed} "
            f"the config's bounds need (3 sockets x bus.max_connections {max_connections}, "
            f"{shm_descriptors(shm)} for shm.sock's clients, a reserve of "
            f"{RESERVED_DESCRIPTORS}): {CHANGE}",
            limit=soft,
            needed=needed,
        )
    log.info("open_files_limit", limit=soft, needed=needed)
    return soft
