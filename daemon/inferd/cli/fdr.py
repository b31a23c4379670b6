"""``inferd fdr dump``, ``inferd fdr verify`` and ``inferd fdr export --mcap``: read a
recorder directory."""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from inferd.fdr.reader import ReadReport, Record, json_default, json_text, read_records
from inferd_client.cli_format import printable

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def parse_since(text: str, now_ns: int | None = None) -> int:
    """``--since``: ``15m`` / ``2h`` / ``90s`` / ``1d`` ago, an ISO-8601 time, or
    epoch seconds; returns wall-clock ns.  ValueError with a clear message."""
    now = time.time_ns() if now_ns is None else now_ns
    relative = _RELATIVE.match(text.strip())
    if relative:
        return now - _ns(text, float(relative.group(1)) * _UNIT_S[relative.group(2)])
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return _ns(text, seconds)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"--since {text!r}: use e.g. 15m, 2h, an ISO-8601 time or epoch seconds"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    # in integers: ``timestamp() * 1e9`` is a float, ~256 ns off for dates today,
    # which puts a record at exactly the given microsecond on either side
    since_epoch = moment - _EPOCH
    return (
        since_epoch.days * 86_400 + since_epoch.seconds
    ) * 10**9 + since_epoch.microseconds * 1000


def _ns(text: str, seconds: float) -> int:
    nanoseconds = seconds * 1e9
    # inf, nan, 1e400 (inf) and 1e300 (inf once in ns) have no int form
    if not math.isfinite(nanoseconds):
        raise ValueError(f"--since {text!r} is out of range")
    return int(nanoseconds)


def _iso(wall_ns: int) -> str:
    moment = datetime.fromtimestamp(wall_ns / 1e9, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


_BARE = re.compile(r"[\w.:/@+,-]+")


def _value_text(value: object) -> str:
    """A payload value for a person: a plain word as it is, other strings quoted,
    ``null`` for none, everything else compact JSON (never a Python repr)."""
    if isinstance(value, str) and _BARE.fullmatch(value):
        return value
    if isinstance(value, bytes):
        return value.hex()
    return json.dumps(value, separators=(",", ":"), default=json_default)


def _human(record: Record) -> str:
    # a kind or key with a newline or an escape sequence could forge lines or drive
    # the terminal: quoted (JSON-escaped) unless a plain word, as string values are
    fields = " ".join(
        f"{_value_text(key)}={_value_text(value)}" for key, value in record.payload.items()
    )
    return f"{_iso(record.wall_ns)}  seq={record.seq:<8} {_value_text(record.kind):<28} {fields}"


def check_kinds(kinds: list[str]) -> list[str]:
    """``--kind`` values as record kinds (``c7.`` names of old recorders accepted);
    ``ValueError`` naming an unknown one and the nearest known kinds."""
    import difflib

    from inferd.fdr.kinds import KINDS, RETIRED_KINDS
    from inferd.fdr.reader import current_kind_name

    checked = []
    for kind in kinds:
        name = current_kind_name(kind)
        if name not in KINDS and name not in RETIRED_KINDS:
            near = difflib.get_close_matches(name, [*KINDS, *RETIRED_KINDS], n=3)
            hint = f"; did you mean {' or '.join(near)}?" if near else "."
            raise ValueError(f"--kind {kind!r} is no record kind{hint} Known: {sorted(KINDS)}")
        checked.append(name)
    return checked


def dump(
    directory: Path,
    *,
    kinds: list[str],
    since_wall_ns: int | None,
    as_json: bool,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    report = ReadReport()
    for record in read_records(directory, report, kinds=kinds, since_wall_ns=since_wall_ns):
        out.write((json_text(record.as_dict()) if as_json else _human(record)) + "\n")
    if report.skipped_bytes:
        err.write(_summary(report) + "\n")
    _said_left_out(report, err)
    return 0


def _said_left_out(report: ReadReport, err: TextIO) -> None:
    """``--since`` compares wall clocks, which a boot may set after its first records (no
    RTC: 1970, or a saved time; then NTP or GPS): earlier records of a boot it shows are
    said, not silently left out (they may be this flight's first)."""
    if report.left_out_of_shown_boots:
        err.write(
            f"inferd: --since left out {report.left_out_of_shown_boots} earlier record(s) "
            "of the boot(s) it shows or the last one recorded (stamped before the window, "
            "maybe before the clock was set): read them without --since\n"
        )


def export(
    directory: Path,
    mcap: Path,
    *,
    kinds: list[str],
    since_wall_ns: int | None,
    err: TextIO | None = None,
) -> int:
    """Write the records to ``mcap`` (``inferd.fdr.mcap_export``); damage is skipped
    and summarised on ``err`` (stderr) as ``dump`` does.  Exit 2 for an ``--mcap``
    that names a directory or a file in none (checked before reading), 1 when
    writing fails; either way nothing is left behind (the temp file is removed)."""
    from inferd.fdr.mcap_export import export_mcap

    err = sys.stderr if err is None else err
    if mcap.is_dir() or not mcap.parent.is_dir():
        what = "is a directory" if mcap.is_dir() else f"is in no directory ({mcap.parent})"
        err.write(f"inferd: --mcap {mcap} {what}: name a file in an existing directory\n")
        return 2
    report = ReadReport()
    records = read_records(directory, report, kinds=kinds, since_wall_ns=since_wall_ns)
    try:
        summary = export_mcap(records, mcap, report=report, source=str(directory))
    except ImportError as exc:
        err.write(
            f"inferd: fdr export --mcap needs the mcap package: {exc} (pip install 'inferd[ops]')\n"
        )
        return 2
    except OSError as exc:  # permission, a full disk: the recorder's own reads never raise
        err.write(f"inferd: cannot write {mcap}: {exc.strerror or exc}\n")
        return 1
    # kinds as the file says them: a recording copied from elsewhere may hold any
    channels = ", ".join(f"{kind} {count}" for kind, count in sorted(summary.channels.items()))
    err.write(
        printable(f"wrote {summary.records} record(s) to {mcap}: {channels or 'none'}") + "\n"
    )
    if summary.schemaless:
        schemaless = ", ".join(summary.schemaless)
        err.write(printable(f"  no schema for {schemaless}: schemaless channels") + "\n")
    if report.skipped_bytes:
        err.write(_summary(report) + "\n")
    _said_left_out(report, err)
    return 0


def verify(directory: Path, *, as_json: bool, out: TextIO | None = None) -> int:
    """Exit 1 on corruption other than torn tails (a payload nested deeper than
    the recorder writes included: the reader calls it so), and on damage the seqs
    show (``sequence_damage``), with a summary."""
    out = sys.stdout if out is None else out
    report = ReadReport()
    records = list(read_records(directory, report))
    gaps = sum(1 for a, b in itertools.pairwise(records) if b.seq != a.seq + 1)
    damage = sequence_damage(records)
    result = {
        **report.as_dict(),
        "seq_gaps": gaps,
        "sequence_damage": damage,
        "ok": not report.is_corrupt and not damage,
        "directory": str(directory),
    }
    if as_json:
        out.write(json.dumps(result) + "\n")
    else:
        verdict = "OK" if result["ok"] else "CORRUPT"
        out.write(f"{verdict}: {directory}\n{_summary(report)}; seq gaps: {gaps}\n")
        for damage_found in report.corrupt + report.unreadable_segments:
            out.write(
                f"  corrupt {damage_found.segment} @{damage_found.offset} "
                f"({damage_found.length} bytes): {damage_found.reason}\n"
            )
        for damage_found in report.torn_tails:
            out.write(
                f"  torn tail {damage_found.segment} @{damage_found.offset} "
                f"({damage_found.length} bytes)\n"
            )
        for said in damage:
            out.write(printable(f"  {said}") + "\n")
    return 0 if result["ok"] else 1


def sequence_damage(records: list[Record]) -> list[str]:
    """What the seqs of whole, intact frames show of damage the frames cannot: the
    recorder numbers every record it writes one more than the last, across segments
    and restarts, and reports what it lost (numbered but not durable: a failed write
    or sync) in the ``fdr_dropped`` records after the gap.  So a seq that does not
    grow (a segment moved, renamed, or another's appended) and missing seqs that no
    later ``fdr_dropped`` counts (a segment cut at a frame's end, or removed: whole
    records gone) are damage.  Gaps are matched with the drops counted after them,
    oldest first; a recording that begins past seq 1 (its oldest segments deleted by
    the size cap) is not."""
    damage: list[str] = []
    missing: list[list[int | str]] = []  # [count still unaccounted, where]
    for before, record in itertools.pairwise(records):
        if record.seq <= before.seq:
            damage.append(
                f"seq {record.seq} in {record.segment} after seq {before.seq} in "
                f"{before.segment}: records out of order"
            )
        elif record.seq > before.seq + 1:
            where = f"seq {before.seq + 1}..{record.seq - 1} missing after {before.segment}"
            missing.append([record.seq - before.seq - 1, where])
        if record.kind == "fdr_dropped":
            accounted = int(record.payload.get("dropped", 0))
            for gap in missing:
                taken = min(int(gap[0]), accounted)
                gap[0], accounted = int(gap[0]) - taken, accounted - taken
    damage += [f"{gap[1]}: no fdr_dropped counts them" for gap in missing if int(gap[0]) > 0]
    return damage


def _summary(report: ReadReport) -> str:
    return (
        f"{report.segments} segment(s), {report.records} record(s), "
        f"{len(report.torn_tails)} torn tail(s), {len(report.corrupt)} corrupt region(s), "
        f"{len(report.unreadable_segments)} unreadable segment(s), "
        f"{report.skipped_bytes} byte(s) skipped"
    )
