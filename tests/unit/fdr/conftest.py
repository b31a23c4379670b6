"""Shared by the flight data recorder tests: an alert hook that keeps what it is given,
the logs kept quiet, and a segment of records written by hand."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from inferd.fdr import framing
from inferd.types import Alert, AlertLevel
from tests.unit.fdr.test_fdr import miss


class KeptAlerts:
    """An alert hook that keeps what it is given (the PUB and MAVLink hooks' place)."""

    name = "ground"

    def __init__(self) -> None:
        self.alerts: list[Alert] = []

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        self.alerts.append(Alert(level, code, message, dict(fields)))

    def close(self) -> None:
        """Nothing to release."""


@pytest.fixture
def quiet_logs() -> Iterator[None]:
    """The daemon's log lines captured, not printed (``usefixtures`` for a module)."""
    with structlog.testing.capture_logs():
        yield


def record_frame(seq: int) -> bytes:
    """A ``deadline_miss`` record numbered ``seq``, framed as the writer frames it."""
    body = framing.encode_body(
        {
            "kind": "deadline_miss",
            "schema_version": 1,
            "seq": seq,
            "wall_ns": 1,
            "mono_ns": 1,
            "boot_id": "x",
            "payload": miss(1),
        }
    )
    return framing.encode_frame(body)


def segment_with_seqs(directory: Path, *seqs: int) -> None:
    """Segment 1 in ``directory`` (made if need be), holding a record of each seq."""
    directory.mkdir(mode=0o750, exist_ok=True)
    frames = b"".join(record_frame(seq) for seq in seqs)
    (directory / framing.segment_name(1)).write_bytes(framing.encode_segment_header(1, 0) + frames)
