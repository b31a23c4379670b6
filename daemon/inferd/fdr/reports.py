"""The records the recorder writes about itself, built on the writer's thread:
``fdr_dropped`` (records lost) and ``fdr_retention`` (segments the size cap
deleted).  Each carries what it reports (``Pending.dropped``, ``Pending.deleted``),
so that the writer reports it again if the record itself is lost."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inferd.fdr import kinds
from inferd.fdr.queued import Pending

#: How the writer encodes a record (``FlightRecorder._encode``).
Encode = Callable[[kinds.RecordKind, Mapping[str, Any]], Pending]

_DROPPED = kinds.KINDS["fdr_dropped"]
_RETENTION = kinds.KINDS["fdr_retention"]
#: The most of the reasons an fdr_dropped record keeps: it must fit any segment.
_REASON_CHARS = 256


def describe(exc: Exception) -> str:
    """An error as a drop's reason and ``last_error`` say it: its ``strerror``, else its text."""
    strerror = exc.strerror if isinstance(exc, OSError) else None
    return strerror or str(exc) or type(exc).__name__


def drop_report(count: int, reasons: list[str], encode: Encode) -> Pending:
    """An fdr_dropped record: ``count`` records lost, for ``reasons``."""
    reason = "; ".join(reasons)[:_REASON_CHARS]
    pending = encode(_DROPPED, {"dropped": count, "reason": reason})
    pending.dropped = (count, reasons)
    return pending


def retention_report(
    deleted: list[tuple[str, int]], max_total_bytes: int, encode: Encode
) -> Pending:
    """An fdr_retention record naming as many of the ``deleted`` segments (taken out
    of the list) as a segment holds."""
    count = len(deleted)
    while True:
        named = deleted[:count]
        payload = {
            "deleted_segments": [name for name, _ in named],
            "deleted_bytes": sum(size for _, size in named),
            "max_total_bytes": max_total_bytes,
        }
        try:
            pending = encode(_RETENTION, payload)
            break
        except kinds.RecordPayloadError:
            if count == 1:
                raise
            count //= 2
    del deleted[:count]
    pending.deleted = named
    return pending
