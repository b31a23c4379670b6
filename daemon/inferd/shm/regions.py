"""The mapped regions, their owners, their limits and who uses them.

A ``Region`` is one client's sealed memfd, mapped (``memfd.map_sealed_memfd``)
and named by 128 random bits.  It belongs to the ``shm.sock`` connection that
brought it (``Connection``: the peer's pid/uid/gid from ``SO_PEERCRED``) and
lives until that connection unregisters it or goes away, or the daemon stops.
A request that names it holds a lease (``leases.RequestRegions``) from admission on
the bus thread until its reply is built on the engine worker (or until it is
answered without running); a closed region keeps its mapping while any lease
holds it, and is unmapped on the registration thread once none does: the
memory under a running inference is never unmapped.

How a region is unmapped, and why a view that outlived its lease keeps it
mapped: ``region``.

Mapped bytes are counted per uid and in total, and regions per connection and
in all (each a mapping and a descriptor: ``mmap`` keeps a duplicate of the
memfd), from registration until the mapping is really gone, and bounded by
``[shm]`` (``RESOURCE_EXHAUSTED``): a released region (unregistered, or its
connection gone) counts while requests lease it and until the registration
thread has unmapped it, so no churn of register, request and unregister makes
the daemon hold more than the bounds (regions in all: ``max_connections`` x
``max_regions_per_connection``).  A refusal says how much of the bound released
regions hold, and whose (``Released``).  A registration at a bound that regions
awaiting the registration thread would make room under (its connection's, its
uid's, or any for the daemon-wide bounds) waits for that thread, woken at once,
up to ``unmap_wait_s``; one wait that timed out (a release hook holds the thread
up) makes no registration wait again until that thread has finished a pass, so
the thread reading registrations (the bus thread) waits once per hold-up.
All state is behind one lock; nothing blocking runs under it.

``status`` is read by operators through a reply of at most 64 KiB
(``protocol.MAX_HEADER_BYTES``, ``OperatorClient``), whatever clients register:
it lists the ``STATUS_REGIONS`` largest regions, each label at most
``MAX_LABEL_BYTES`` of UTF-8, with the count of those it leaves out, and the
bytes of the ``LISTED_UIDS`` uids that map the most, the others summed under
``OTHER_UIDS``.
"""

from __future__ import annotations

import heapq
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog

from inferd.config import ShmConfig
from inferd.shm.credentials import PeerCredentials as PeerCredentials
from inferd.shm.memfd import map_sealed_memfd
from inferd.shm.region import Connection as Connection
from inferd.shm.region import Region as Region
from inferd.shm.released import Released, connection_bound_note, released_note
from inferd_wire.protocol import Code, ProtocolError
from inferd_wire.regions import shown

log = structlog.get_logger("inferd.shm")

#: Regions ``status`` lists (the largest; ``regions_omitted`` counts the rest).  A
#: listed region takes at most 192 bytes of the reply (a 64-byte label, every
#: number at msgpack's widest), so 32 take 6 KiB, and ``status.shm`` at most 8.2
#: KiB, of the 64 KiB every operator client accepts, however many regions the
#: bounds allow (up to 16,384 x 1,024); ``inferctl status`` stays one screen.
STATUS_REGIONS = 32
#: Uids ``status`` names one by one in a count by uid (those that hold the most);
#: the rest are summed under ``OTHER_UIDS``, so a map by uid takes at most 338
#: bytes, and a metric labelled by uid at most 17 series, however many users connect.
LISTED_UIDS = 16
OTHER_UIDS = "other"


def listed_by_uid(counts: Mapping[int, int]) -> dict[str, int]:
    """``counts`` as ``status`` shows them: the ``LISTED_UIDS`` largest by uid, and
    the rest summed under ``OTHER_UIDS`` (absent when there is none)."""
    listed = heapq.nlargest(LISTED_UIDS, counts.items(), key=lambda item: item[1])
    shown_uids = {str(uid): count for uid, count in listed}
    if len(counts) > len(listed):
        shown_uids[OTHER_UIDS] = sum(counts.values()) - sum(shown_uids.values())
    return shown_uids


class RegionTable:
    """Every region of the daemon.  ``register``, ``unregister``, ``disconnect``,
    ``lease`` and ``unlease`` come from whichever thread reads the connection or
    serves the request (the engine worker, the bus thread); only the registration
    thread unmaps (``release_due``, ``close_all``): the others wake it."""

    def __init__(
        self, config: ShmConfig, wake: Callable[[], None] = lambda: None, unmap_wait_s: float = 0.0
    ) -> None:
        self._config = config
        self._wake = wake
        #: How long a registration at a bound waits for the registration thread to
        #: unmap released regions no request holds (``_await_unmapping``).
        self._unmap_wait_s = unmap_wait_s
        self._lock = threading.Lock()
        self._unmapped = threading.Condition(self._lock)
        #: A wait timed out and the registration thread has not finished a pass of
        #: ``release_due`` since (a release hook holds it up): no registration waits.
        self._held_up = False
        self._regions: dict[str, Region] = {}
        #: Closed regions still mapped: leased, awaiting this thread, or a view
        #: outlived its lease.
        self._closing: list[Region] = []
        #: The same, by owner uid: what of the bounds they hold, for a refusal.
        self._released: dict[int, Released] = {}
        self._mapped_by_uid: dict[int, int] = {}
        self._mapped_total = 0
        #: Regions mapped: every connection's ``held``, closed connections' included.
        self._held = 0
        self.registered = 0
        self.unregistered = 0
        self.released_on_disconnect = 0
        self.unmapped = 0
        self.refused: dict[str, int] = {}

    # -- the connection's reader ------------------------------------------------
    def register(self, connection: Connection, fd: int, label: str | None) -> Region:
        """Map ``fd`` for ``connection``; ``ProtocolError`` (nothing held) when it is
        not a sealed memfd or a limit would be exceeded."""
        limit = self._config.max_regions_per_connection
        if connection.held >= limit and self._await_unmapping(
            lambda: connection.held < limit, lambda region: region.connection is connection
        ):
            released = connection.held - len(connection.regions)
            raise ProtocolError(Code.RESOURCE_EXHAUSTED, connection_bound_note(limit, released))
        uid = connection.peer.uid
        # The bounds are checked before the memfd is mapped, then again under the lock.
        mapping, size = map_sealed_memfd(fd, lambda size: self._check_room(uid, size))
        with self._lock:
            error = self._no_room(uid, size)
            code = Code.RESOURCE_EXHAUSTED
            if connection.closed:
                # It went while this registration was mapped (another thread read
                # its end): nothing would ever release the region.
                error, code = "the connection closed", Code.UNAVAILABLE
            if error is None:
                region = Region(secrets.token_hex(16), connection, mapping, size, label)
                self._regions[region.region_id] = region
                connection.regions[region.region_id] = region
                connection.held += 1
                self._held += 1
                self._mapped_by_uid[uid] = self._mapped_by_uid.get(uid, 0) + size
                self._mapped_total += size
                self.registered += 1
        if error is not None:
            mapping.close()
            raise ProtocolError(code, error)
        log.info(
            "shm_region_registered",
            region=region.shown_id,
            nbytes=size,
            uid=uid,
            pid=connection.peer.pid,
            label=label,
        )
        return region

    def _check_room(self, uid: int, size: int) -> None:
        """RESOURCE_EXHAUSTED when a region of ``size`` bytes for ``uid`` would not fit."""
        with self._lock:
            error = self._no_room(uid, size)
        if error is not None and self._await_unmapping(
            lambda: self._no_room(uid, size) is None,
            # Over its uid's bytes, only its own uid's unmapping makes room.
            lambda region: (
                region.owner.uid == uid
                or self._mapped_by_uid.get(uid, 0) + size <= self._config.max_bytes_per_uid
            ),
        ):
            with self._lock:
                error = self._no_room(uid, size)
            if error is not None:
                raise ProtocolError(Code.RESOURCE_EXHAUSTED, error)

    def _await_unmapping(self, room: Callable[[], bool], helps: Callable[[Region], bool]) -> bool:
        """At a bound: wait (up to ``unmap_wait_s``) while released regions no request
        holds await the registration thread and ``room`` (called with the lock held)
        is false.  A client that unregistered an idle region to make room is then not
        refused for the moment that thread takes to run (it is woken at once).  True
        when there is still no room."""
        with self._unmapped:
            if (
                self._unmap_wait_s
                and not room()
                and not self._held_up
                and any(helps(region) for region in self._awaiting())
            ):
                self._wake()
                if not self._unmapped.wait_for(
                    lambda: room() or not any(helps(region) for region in self._awaiting()),
                    self._unmap_wait_s,
                ):
                    self._held_up = True
            return not room()

    def _awaiting(self) -> Iterator[Region]:
        """Released regions the registration thread is about to unmap (lock held)."""
        return (r for r in self._closing if r.leases == 0 and not r.unmap_failed)

    def _no_room(self, uid: int, size: int) -> str | None:
        """Why a region of ``size`` bytes for ``uid`` would exceed a bound, or None
        (with the lock held)."""
        by_uid = self._mapped_by_uid.get(uid, 0)
        if self._held >= self._max_held:
            return self._held_in_all()
        if by_uid + size > self._config.max_bytes_per_uid:
            own = self._released.get(uid)
            return (
                f"uid {uid} has {by_uid} bytes mapped; this region's {size} would exceed "
                f"shm.max_bytes_per_uid ({self._config.max_bytes_per_uid})"
                + ("" if own is None else f", {own.nbytes} of them in {own.why()}")
            )
        if self._mapped_total + size > self._config.max_bytes_total:
            return (
                f"the daemon has {self._mapped_total} bytes mapped; this region's {size} "
                f"would exceed shm.max_bytes_total ({self._config.max_bytes_total})"
                + released_note(self._released, nbytes=True)
            )
        return None

    def unregister(self, connection: Connection, region_id: str) -> None:
        """Close one region of ``connection``; NOT_FOUND if it holds no such region."""
        with self._lock:
            region = connection.regions.pop(region_id, None)
            if region is not None:
                connection.unregistered.append(region_id)
                self._close(region)
                self.unregistered += 1
        if region is None:
            known = region_id in connection.unregistered
            state = "was already unregistered" if known else "is not registered on this connection"
            raise ProtocolError(Code.NOT_FOUND, f"region {shown(region_id)} {state}")
        self._wake()  # unmapped on the registration thread

    def disconnect(self, connection: Connection) -> None:
        """The connection went away (client exit, kill): close all its regions."""
        with self._lock:
            connection.closed = True
            regions = list(connection.regions.values())
            connection.regions.clear()
            for region in regions:
                self._close(region)
            self.released_on_disconnect += len(regions)
        if regions:
            log.info(
                "shm_connection_closed",
                regions=len(regions),
                pid=connection.peer.pid,
                uid=connection.peer.uid,
            )
            self._wake()  # unmapped on the registration thread

    def _close(self, region: Region) -> None:
        # With the lock held.  It stays counted (``held``, the mapped bytes) until
        # ``release_due`` has unmapped it.
        self._regions.pop(region.region_id, None)
        region.closing = True
        self._closing.append(region)
        released = self._released.setdefault(region.owner.uid, Released())
        released.regions += 1
        released.nbytes += region.size
        released.in_use += 1 if region.leases else 0

    @property
    def _max_held(self) -> int:
        return self._config.max_connections * self._config.max_regions_per_connection

    def _held_in_all(self) -> str:
        return (
            f"the daemon holds {self._held} regions, counting those of closed connections "
            "and those unregistered until they are unmapped (shm.max_connections x "
            f"shm.max_regions_per_connection = {self._max_held})"
            + (released_note(self._released) or "; try again once some are unregistered")
        )

    def release_due(self) -> None:
        """Unmap every closed region no lease holds (hooks run outside the lock)."""
        with self._lock:
            due = [region for region in self._closing if region.leases == 0]
        for region in due:
            done = region.unmap()
            with self._lock:
                if done:
                    self._closing.remove(region)
                    uid = region.owner.uid
                    self._mapped_by_uid[uid] -= region.size
                    if not self._mapped_by_uid[uid]:
                        del self._mapped_by_uid[uid]
                    self._mapped_total -= region.size
                    region.connection.held -= 1
                    self._held -= 1
                    released = self._released[uid]
                    released.regions -= 1
                    released.nbytes -= region.size
                    if not released.regions:
                        del self._released[uid]
                    self.unmapped += 1
                    self._unmapped.notify_all()
                elif not region.unmap_failed:
                    region.unmap_failed = True
                    log.error("shm_region_still_viewed", region=region.shown_id)
        with self._lock:
            self._held_up = False  # a pass done: registrations may wait for the next

    def close_all(self) -> None:
        """Shutdown: close every region (requests are over) and unmap them."""
        with self._lock:
            for region in list(self._regions.values()):
                self._close(region)
        self.release_due()

    # -- bus thread and engine worker --------------------------------------------
    def lease(self, region_id: str, peer_uid: int | None) -> Region:
        """The live region ``region_id``, with a lease taken; ``NOT_FOUND`` (unknown
        or closed) or ``PERMISSION_DENIED`` (the request's peer is known to be
        another uid than the region's owner)."""
        with self._lock:
            region = self._regions.get(region_id)
            if region is not None and (peer_uid is None or peer_uid == region.owner.uid):
                region.leases += 1
                return region
        if region is None:
            raise ProtocolError(
                Code.NOT_FOUND,
                f"no region {shown(region_id)} is registered (never, or unregistered, or its "
                "registration connection closed)",
            )
        raise ProtocolError(
            Code.PERMISSION_DENIED,
            f"region {region.shown_id} belongs to uid {region.owner.uid}; this request comes "
            f"from uid {peer_uid}",
        )

    def unlease(self, region: Region) -> None:
        with self._lock:
            region.leases -= 1
            due = region.closing and region.leases == 0
            if due:
                self._released[region.owner.uid].in_use -= 1
        if due:
            self._wake()  # unmapped on the registration thread, never here

    # -- status -------------------------------------------------------------------
    def mapped_bytes(self) -> int:
        return self._mapped_total

    def status(self) -> dict[str, Any]:
        with self._lock:
            regions = [*self._regions.values(), *self._closing]
            listed = _largest(regions)
            return {
                "mapped_bytes": self._mapped_total,
                "mapped_bytes_by_uid": listed_by_uid(self._mapped_by_uid),
                "releasing_regions": len(self._closing),
                "releasing_bytes": sum(held.nbytes for held in self._released.values()),
                "regions": [_describe(region) for region in listed],
                "regions_mapped": len(regions),
                "regions_omitted": len(regions) - len(listed),
                "registered": self.registered,
                "unregistered": self.unregistered,
                "released_on_disconnect": self.released_on_disconnect,
                "unmapped": self.unmapped,
                "refused": dict(self.refused),
            }

    def count_refusal(self, code: Code) -> None:
        with self._lock:
            self.refused[str(code)] = self.refused.get(str(code), 0) + 1


def _largest(regions: list[Region]) -> list[Region]:
    """The ``STATUS_REGIONS`` largest of ``regions`` (the earlier of equal sizes),
    in their order: registered as registered, then releasing."""
    if len(regions) <= STATUS_REGIONS:
        return regions
    kept = heapq.nlargest(STATUS_REGIONS, range(len(regions)), key=lambda i: regions[i].size)
    return [regions[i] for i in sorted(kept)]


def _describe(region: Region) -> dict[str, Any]:
    return {
        "id": region.shown_id,
        "label": region.label,
        "owner": {"uid": region.owner.uid, "gid": region.owner.gid, "pid": region.owner.pid},
        "nbytes": region.size,
        "in_use": region.leases,
        "state": "releasing" if region.closing else "registered",
        "created_unix_s": round(region.created_unix_s, 3),
    }
