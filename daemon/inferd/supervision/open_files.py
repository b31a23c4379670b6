"""The process's limit on open descriptors (``RLIMIT_NOFILE``).

Every connection to the daemon's sockets is a descriptor, and libzmq aborts the
process when an ``ipc://`` accept fails for want of one (``EMFILE`` is not among
the errors its listener tolerates).  systemd starts services with a soft limit
of 1024 for the sake of ``select(2)``, which the daemon does not use, and
``systemd/inferd.service`` sets ``LimitNOFILE=65536``; the daemon raises its soft
limit to the hard one at start, and says when that leaves too little room for
``bus.max_connections`` on its three ZeroMQ sockets (DESIGN.md 128).
"""

from __future__ import annotations

import resource

import structlog

log = structlog.get_logger("inferd.supervision")

#: Descriptors the daemon holds besides its sockets' connections: recorder
#: segments, engines, models, shm regions and connections, the metrics server,
#: ZeroMQ's own (its I/O threads' and the inproc pairs').
RESERVED_DESCRIPTORS = 1024


def raise_open_files_limit(max_connections: int) -> int:
    """Raise the soft limit to the hard one; the limit now.  Logged, as a warning
    when three sockets of ``max_connections`` each and the reserve do not fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a container's nr_open below the hard limit
            log.warning("open_files_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    needed = 3 * max_connections + RESERVED_DESCRIPTORS
    if soft < needed:
        log.warning(
            "open_files_limit_low",
            limit=soft,
            needed=needed,
            hint="raise LimitNOFILE= (systemd) or lower bus.max_connections",
        )
    else:
        log.info("open_files_limit", limit=soft, needed=needed)
    return soft
