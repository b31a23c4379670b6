"""The descriptor guard: what a flood of connections that never greet can take
of the daemon's descriptors is bounded (DESIGN.md 128).

libzmq aborts the process (SIGABRT) when an ``ipc://`` accept fails with
``EMFILE`` (``src/ipc_listener.cpp`` tolerates ``ENFILE`` but not ``EMFILE``), and
a connection that never sends its greeting never reaches the ZAP handler, which
holds each peer to ``bus.max_connections`` only at a handshake: for the 5 s of
``ZMQ_HANDSHAKE_IVL`` such a connection is bounded by nothing but the limit on
open descriptors.  One local user opening raw connections to ``infer.sock``
(about 25,000 a second from one Python loop) fills the unit's 65,536 in 3 s.

The guard (a thread of its own, ``inferd-fd-guard``) looks every ``period_s`` at
how full the descriptor table is, and once it is past ``threshold`` (an eighth of
the soft limit) ends, in one pass over the descriptors, the connections each
peer (a local user, a remote address) holds to a bound socket past
``bus.max_connections`` (``end_extra_connections``: ``shutdown``, never ``close``,
so that libzmq closes the descriptor it owns itself).  While passes end
connections the next one starts at once: during a flood the guard keeps up with
it, at 10 to 30 us a connection ended (``descriptor_scan``), and the table stayed
under a third of the limit (a flood of 60,000 at 20,000: a peak of 5,800).

The look is the lowest free descriptor number: the kernel gives each new
descriptor the lowest free number, so a flood takes the holes first and
``EMFILE`` comes exactly when that number reaches the limit.  It costs a ``dup``
and a ``close``, about 1.5 us at 100 descriptors and at 20,000, where listing
``/proc/self/fd`` costs 70 us and 30 ms.  The period is derived from the room
between the threshold and the limit: ``LOOKS_PER_ROOM`` looks while a flood at
``FLOOD_RATE`` would fill it (0.1 s at the unit's 65,536, 18 ms at 4,096).  A pass
that ended nothing (the daemon's own descriptors, or many peers each within the
bound) is not repeated until the table has filled by another ``RESCAN_FRACTION``
of that room or reached ``share_level``, so a table that stays full costs a few
passes.

Many peers each within the bound (86 users at 256 on each of three sockets fill
65,536) are held by the second stage: once the table is past ``share_level`` (a
quarter of the limit) the pass, having counted every peer's connections, also
holds what they keep in all to ``share_target`` (the threshold, where the guard
starts acting, or what one peer may hold on all the sockets when more): each peer
keeps its oldest up to the largest share that fits (water-filling,
``fair_shares``), so a client holding a few keeps them while the peers holding
most lose what they hold past the share.  While such passes end
connections the next one shares too, whatever the lowest free descriptor (one of
the holes the last pass made).  An episode (passes that ended connections, until
the table has stayed below the threshold for ``QUIET_S``) is logged once as it
starts, once as its first pass ends connections past a share, and once as it
ends, and counted in ``status.security.descriptor_guard``.
"""

from __future__ import annotations

import fcntl
import os
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from inferd.bus.descriptor_scan import Ended, SocketPeer, end_extra_connections
from inferd.bus.endpoint_connections import EndpointConnections

log = structlog.get_logger("inferd.security")

#: The guard acts once the descriptor table is past 1/THRESHOLD_DIVISOR of the
#: soft limit (8,192 of 65,536): above what the daemon holds otherwise
#: (``open_files.descriptors_needed``: 2,450 with the defaults, one peer at the
#: bound on each socket), and the rest is room for the flood that goes on while
#: the guard looks and ends connections.
THRESHOLD_DIVISOR = 8
#: Connections a second the period is sized for: one Python loop opened 25,000 a
#: second here (libzmq accepts on one I/O thread; four processes got 18,000).
FLOOD_RATE = 50_000
#: Past 1/SHARE_LEVEL_DIVISOR of the limit (16,384 of 65,536) a pass also holds what
#: all peers keep to ``share_target``.  The room above it is what a flood of many
#: users fills while the guard, short of CPU beside them, makes its pass: 20 users
#: opening 5,120 at a limit of 4,096 on 2 vCPUs found the table at 4,036 or more in
#: 4 of 30 tries with the level at half, and at 3,133 at most with it at a
#: quarter (at 2,048, half let the daemon die in 2 of 30 tries; a quarter, none of
#: 40).  Below the level many peers are tolerated (a burst of clients); past it a
#: pass ends only what they hold past the threshold in all, which one peer's flood
#: (``max_connections`` on each socket, 768 with the defaults) never does.
SHARE_LEVEL_DIVISOR = 4
#: Looks while a flood at ``FLOOD_RATE`` fills the room between threshold and limit.
LOOKS_PER_ROOM = 4
MIN_PERIOD_S = 0.001
MAX_PERIOD_S = 0.1
#: After a pass that ended nothing, the next waits until the table has filled by
#: another 1/RESCAN_FRACTION of the room.
RESCAN_FRACTION = 8
#: An episode ends once the table has stayed below the threshold this long.
QUIET_S = 10.0
#: Peers named in an episode's log lines.
LOGGED_PEERS = 8


@dataclass(frozen=True)
class GuardLimits:
    """What the guard derives from the soft limit on open descriptors."""

    limit: int
    threshold: int
    period_s: float
    #: How much fuller the table must be before a pass that ended nothing is repeated.
    rescan_step: int
    #: Past this lowest free descriptor a pass holds what all peers keep to ...
    share_level: int
    #: ... this many connections (the threshold: the table falls back to where the
    #: guard starts acting, above what the daemon holds otherwise; or ``one_peer``
    #: when more).
    share_target: int

    @classmethod
    def of(cls, limit: int, one_peer: int = 0) -> GuardLimits:
        """``one_peer``: what one peer may hold on all the sockets within the bound
        (``bus.max_connections`` on each), which the daemon's start made sure the
        limit fits (``open_files``).  The target is never below it, so one peer
        within the bound never loses a connection to a share: at a limit near the
        lowest the daemon accepts (2,450 with the defaults, whose eighth is 306) the
        threshold is below one peer's 768."""
        threshold = limit // THRESHOLD_DIVISOR
        room = limit - threshold
        period_s = room / FLOOD_RATE / LOOKS_PER_ROOM
        return cls(
            limit=limit,
            threshold=threshold,
            period_s=min(MAX_PERIOD_S, max(MIN_PERIOD_S, period_s)),
            rescan_step=max(1, room // RESCAN_FRACTION),
            share_level=limit // SHARE_LEVEL_DIVISOR,
            share_target=max(threshold, one_peer),
        )


def soft_open_files_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` (raised to the hard one at start, ``open_files``);
    Linux refuses an infinite one for descriptors, ``fs.nr_open`` bounds it."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def lowest_free_descriptor(probe: int) -> int:
    """The number the next descriptor would get (a duplicate of ``probe``, closed
    at once); when none is left, a number past any limit."""
    try:
        duplicate = fcntl.fcntl(probe, fcntl.F_DUPFD_CLOEXEC, 0)
    except OSError:  # EMFILE: full
        return 1 << 31
    os.close(duplicate)
    return duplicate


def _peer_text(peer: SocketPeer, ended: int) -> dict[str, Any]:
    socket, key = peer
    who = {"uid": key} if isinstance(key, int) else {"address": key}
    return {"socket": socket, **who, "ended": ended}


#: The pass: the sockets, ``max_connections``, and the target all peers are held to
#: (None: only the bound).
Trim = Callable[[Mapping[str, EndpointConnections], int, int | None], Ended]


class DescriptorGuard(threading.Thread):
    """Ends each peer's connections past ``max_connections`` while the descriptor
    table is past the threshold, and past a fair share of ``share_target`` while it
    is past ``share_level``; ``sockets`` is the live map the bus threads fill as
    they bind (``SocketSecurity.connections``)."""

    def __init__(
        self,
        sockets: Mapping[str, EndpointConnections],
        max_connections: int,
        limits: GuardLimits,
        *,
        trim: Trim = end_extra_connections,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name="inferd-fd-guard", daemon=True)
        self.limits = limits
        self._sockets = sockets
        self._max_connections = max_connections
        self._trim = trim
        self._clock = clock
        self._stop_requested = threading.Event()
        #: Look again once the lowest free descriptor reaches this.
        self._pass_at = limits.threshold
        #: The open episode's connections ended by peer, and since when the table
        #: has been below the threshold (None: above it, or no episode open).
        self._episode: Counter[SocketPeer] | None = None
        self._episode_past_share = 0
        self._episode_started = 0.0
        self._below_since: float | None = None
        #: The last pass ended connections: look again at once, not after a period.
        self._flooded = False
        #: The last pass ended connections past a share: the next one shares too.
        self._sharing = False
        self.episodes = 0
        self.connections_ended = 0
        self.share_passes = 0
        self.connections_ended_past_share = 0

    def stop(self) -> None:
        self._stop_requested.set()

    def run(self) -> None:
        probe = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            while not self._stop_requested.wait(0 if self._flooded else self.limits.period_s):
                try:
                    self.look(lowest_free_descriptor(probe))
                except Exception:  # a bug: the guard must go on guarding
                    log.exception("descriptor_guard_failed")
        finally:
            os.close(probe)

    def look(self, lowest_free: int) -> None:
        """One look, at the lowest free descriptor number ``lowest_free``."""
        limits = self.limits
        threshold, step, share_level = limits.threshold, limits.rescan_step, limits.share_level
        self._flooded = False
        if lowest_free >= self._pass_at:
            # Right after a pass the lowest free descriptor is one of the holes it
            # made, not how full the table is: while passes end connections past a
            # share, the flood of many peers goes on.
            sharing = lowest_free >= share_level or self._sharing
            target = limits.share_target if sharing else None
            ended = self._trim(dict(self._sockets), self._max_connections, target)
            # What ended frees its descriptors as libzmq closes them: look again
            # as soon as the table is past the threshold; after a pass that ended
            # nothing, once it has filled by another step, or reached the share level.
            self._sharing = sharing and ended.past_share.total() > 0
            if ended.total():
                self._pass_at = threshold
                self._flooded = True
                self._ended(ended)
            elif lowest_free < share_level:
                self._pass_at = min(lowest_free + step, share_level)
            else:
                self._pass_at = lowest_free + step
        elif lowest_free < threshold:
            self._pass_at = threshold  # the table emptied: a pass at the next crossing
        if lowest_free >= threshold:
            self._below_since = None
            return
        now = self._clock()
        if self._below_since is None:
            self._below_since = now
        if self._episode is not None and now - self._below_since >= QUIET_S:
            self._end_episode(now)

    def _ended(self, ended: Ended) -> None:
        by_peer = ended.by_peer()
        self.connections_ended += ended.total()
        if self._episode is None:
            self._episode = Counter()
            self._episode_past_share = 0
            self._episode_started = self._clock()
            self.episodes += 1
            log.warning(
                "descriptor_flood_trimmed",
                limit=self.limits.limit,
                threshold=self.limits.threshold,
                max_connections=self._max_connections,
                ended=ended.total(),
                peers=[_peer_text(peer, n) for peer, n in by_peer.most_common(LOGGED_PEERS)],
            )
        past_share = ended.past_share.total()
        if past_share:
            self.share_passes += 1
            self.connections_ended_past_share += past_share
            if not self._episode_past_share:
                log.warning(
                    "descriptor_flood_shared",
                    limit=self.limits.limit,
                    share_level=self.limits.share_level,
                    share_target=self.limits.share_target,
                    share=ended.share,
                    ended=past_share,
                    peers=[
                        _peer_text(peer, n)
                        for peer, n in ended.past_share.most_common(LOGGED_PEERS)
                    ],
                )
            self._episode_past_share += past_share
        self._episode.update(by_peer)

    def _end_episode(self, now: float) -> None:
        assert self._episode is not None
        log.info(
            "descriptor_flood_ended",
            ended=self._episode.total(),
            past_share=self._episode_past_share,
            duration_s=round(now - self._episode_started, 1),
            peers=[_peer_text(peer, n) for peer, n in self._episode.most_common(LOGGED_PEERS)],
        )
        self._episode = None
        self._sharing = False

    def describe(self) -> dict[str, Any]:
        """``status.security.descriptor_guard``."""
        return {
            "limit": self.limits.limit,
            "threshold": self.limits.threshold,
            "period_s": round(self.limits.period_s, 4),
            "episodes": self.episodes,
            "connections_ended": self.connections_ended,
            "share_level": self.limits.share_level,
            "share_target": self.limits.share_target,
            "share_passes": self.share_passes,
            "connections_ended_past_share": self.connections_ended_past_share,
        }
