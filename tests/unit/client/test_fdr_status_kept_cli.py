"""``inferctl status`` shows how much flight history the recorder keeps on disk and
its cap on the fdr line (``status.fdr.segments_kept``, ``bytes_kept``,
``max_total_bytes``), escaped like every value the daemon sends (DESIGN.md 252)."""

from __future__ import annotations

from typing import Any

from inferd_client import cli_format

FDR = {
    "enabled": True,
    "records_written": 3,
    "bytes_written": 810,
    "records_dropped": 0,
    "durable_seq": 3,
    "segments_kept": 2,
    "bytes_kept": 1_677_722,  # 1.6 MiB
    "max_total_bytes": 256 << 20,
    "oldest_segment": "seg-0000000004.fdr",
    "last_error": None,
}


def fdr_line(fdr: dict[str, Any]) -> str:
    result = {
        "daemon": {"version": "0.1.0", "pid": 7, "state": "serving", "uptime_s": 3.5},
        "models": [],
        "thermal": {"available": False},
        "fdr": fdr,
        "bus": {},
        "alerts": {},
    }
    (line,) = [line for line in cli_format.status(result) if line.startswith("fdr:")]
    return line.split(":", 1)[1].strip()


def test_the_fdr_line_shows_the_segments_and_bytes_kept_of_the_cap() -> None:
    assert fdr_line(FDR) == (
        "3 records (810 B), 0 dropped, durable to #3, 2 segments 1.6 MiB of 256.0 MiB kept"
    )
    one = fdr_line({**FDR, "segments_kept": 1, "bytes_kept": 900, "last_error": "disk full"})
    assert one.endswith(", 1 segment 900 B of 256.0 MiB kept; last error: disk full")
    old = {key: value for key, value in FDR.items() if "kept" not in key}  # an older daemon
    assert fdr_line(old) == "3 records (810 B), 0 dropped, durable to #3"


def test_what_the_daemon_sends_there_reaches_no_terminal_as_controls() -> None:
    line = fdr_line({**FDR, "segments_kept": "2\x1b[2J\r\nforged"})
    assert line.isprintable()
    assert "2\\x1b[2J\\x0d\\x0aforged segments" in line
