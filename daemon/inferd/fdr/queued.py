"""What goes through the recorder's queue to its writer thread: records encoded
but for their seq, and the markers ``wait_durable`` waits on."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from inferd.fdr import kinds


@dataclass
class Pending:
    """A record encoded but for its seq (assigned when it is written)."""

    kind: kinds.RecordKind
    head: bytes
    tail: bytes
    #: What an fdr_dropped / fdr_retention record reports (again, if it is lost).
    dropped: tuple[int, list[str]] | None = None
    deleted: list[tuple[str, int]] | None = None


class Marker(threading.Event):
    """Queued by ``wait_durable``; set once everything before it was processed."""

    durable = False
