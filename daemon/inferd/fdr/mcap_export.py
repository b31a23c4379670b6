"""Flight data recorder records as an MCAP file (``inferd fdr export --mcap``),
for Foxglove and the other tools that read the vehicle's logs.

One channel per record kind, topic ``/inferd/<kind>``, message encoding
``json``: each message is the record's payload, and the channel's schema is the
kind's JSON Schema (``schemas/fdr/<kind>.json``, shipped in the package as
``inferd/fdr/schemas/``; encoding ``jsonschema``; a kind without one gets a
schemaless channel).  A message's log and publish time are the record's wall
clock (``wall_ns``), its sequence the record's ``seq`` (MCAP keeps 32 bits).
What a message cannot carry is in metadata records: ``inferd`` (the exporter's
version, the daemon versions seen in ``daemon_lifecycle`` records, the
source directory, the records and the damage the reader skipped) and one
``inferd.boot`` per boot (its ``boot_id``, first and last ``seq``, and the
first record's ``wall_ns``/``mono_ns``, which relate the monotonic clock of the
boot to the wall clock).  ``mcap`` is imported here only, when exporting.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import inferd
from inferd.durable import atomic_output
from inferd.fdr.reader import ReadReport, Record, json_text

TOPIC_PREFIX = "/inferd/"
MESSAGE_ENCODING = "json"
SCHEMA_ENCODING = "jsonschema"
PROFILE = ""  # no ROS profile: JSON messages (mcap.dev/spec/registry)
_KIND_NAME = re.compile(r"^[a-z0-9][a-z0-9_.]{0,127}$")
_UINT32 = 0xFFFFFFFF


def payload_schema(kind: str) -> bytes | None:
    """``schemas/fdr/<kind>.json`` as shipped in the package, or None."""
    if not _KIND_NAME.match(kind) or ".." in kind:
        return None  # a damaged or foreign kind name never becomes a path
    try:
        return (resources.files("inferd.fdr") / "schemas" / f"{kind}.json").read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


@dataclass
class _Boot:
    boot_id: str
    first_seq: int
    last_seq: int
    first_wall_ns: int
    first_mono_ns: int
    records: int = 0


@dataclass
class ExportSummary:
    records: int = 0
    channels: dict[str, int] = field(default_factory=dict)  # kind -> messages
    schemaless: list[str] = field(default_factory=list)
    boots: list[str] = field(default_factory=list)


def export_mcap(
    records: Iterable[Record], out: Path, *, report: ReadReport, source: str
) -> ExportSummary:
    """Write ``records`` to ``out`` (temp file + rename: ``out`` is either the old
    file or the whole new one); ``report`` is the reader's, filled as ``records``
    is consumed, and goes into the ``inferd`` metadata."""
    from mcap.writer import CompressionType, Writer

    summary = ExportSummary()
    boots: dict[str, _Boot] = {}
    daemon_versions: list[str] = []
    with atomic_output(out) as handle:
        writer = Writer(handle, compression=CompressionType.ZSTD)
        writer.start(profile=PROFILE, library=f"inferd {inferd.__version__}")
        channels: dict[str, int] = {}
        for record in records:
            channel = channels.get(record.kind)
            if channel is None:
                channel = channels[record.kind] = _channel(writer, record, summary)
            wall_ns = max(record.wall_ns, 0)
            writer.add_message(
                channel,
                log_time=wall_ns,
                data=json_text(record.payload).encode(),  # NaN and infinities as null
                publish_time=wall_ns,
                sequence=record.seq & _UINT32,
            )
            summary.records += 1
            summary.channels[record.kind] = summary.channels.get(record.kind, 0) + 1
            _note_boot(boots, record)
            version = record.payload.get("version")
            lifecycle = record.kind == "daemon_lifecycle"
            if lifecycle and isinstance(version, str) and version not in daemon_versions:
                daemon_versions.append(version)
        for boot in boots.values():
            writer.add_metadata("inferd.boot", {key: str(v) for key, v in vars(boot).items()})
        writer.add_metadata(
            "inferd",
            {
                "exporter": f"inferd {inferd.__version__}",
                "daemon_versions": ",".join(daemon_versions),
                "source_directory": source,
                "exported_at_ns": str(time.time_ns()),
                "records": str(summary.records),
                "segments": str(report.segments),
                "skipped_bytes": str(report.skipped_bytes),
                "torn_tails": str(len(report.torn_tails)),
                "corrupt_regions": str(len(report.corrupt)),
                "unreadable_segments": str(len(report.unreadable_segments)),
            },
        )
        writer.finish()  # type: ignore[no-untyped-call]
    summary.boots = list(boots)
    return summary


def _channel(writer: Any, record: Record, summary: ExportSummary) -> int:
    schema = payload_schema(record.kind)
    schema_id = 0  # MCAP: no schema
    if schema is not None:
        schema_id = writer.register_schema(record.kind, SCHEMA_ENCODING, schema)
    else:
        summary.schemaless.append(record.kind)
    return int(
        writer.register_channel(
            TOPIC_PREFIX + record.kind,
            MESSAGE_ENCODING,
            schema_id,
            {"schema_version": str(record.schema_version)},
        )
    )


def _note_boot(boots: dict[str, _Boot], record: Record) -> None:
    boot = boots.get(record.boot_id)
    if boot is None:
        boot = boots[record.boot_id] = _Boot(
            record.boot_id, record.seq, record.seq, record.wall_ns, record.mono_ns
        )
    boot.last_seq = record.seq
    boot.records += 1
