"""A real daemon's ``status.fdr`` says how much flight history its recorder keeps on
disk and the cap (``segments_kept``, ``bytes_kept``, ``max_total_bytes``,
``oldest_segment``), as ``ls``/``du`` would, in the schema; its metrics scrape and
``inferctl status`` show the same numbers."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferd.fdr import framing
from inferd.fdr.reader import list_segments
from inferd_client import OperatorClient
from inferd_client.cli_format import size
from tests.conftest import DaemonFactory, run_inferctl, wait_until
from tests.integration.test_schemas import assert_invalid, assert_valid

pytestmark = pytest.mark.integration

SEGMENT = 1024
FDR_SCHEMA = "status_reply.json#/$defs/fdr"


def earlier_run(directory: Path, count: int) -> None:
    """Full segments an earlier run left: a header, then zeros (a torn tail)."""
    directory.mkdir(mode=0o750)
    for index in range(1, count + 1):
        header = framing.encode_segment_header(index, 1)
        (directory / framing.segment_name(index)).write_bytes(header + bytes(SEGMENT - len(header)))


class Seen(NamedTuple):
    fdr: dict[str, Any]
    disk: list[Path]
    disk_bytes: int
    samples: dict[str, float]
    fdr_line: str


def scrape(listen: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("inferd_fdr_")
    }


def inferctl_fdr_line(control: str) -> str:
    shown = run_inferctl("--control-endpoint", control, "status", check=True).stdout
    (line,) = [line for line in shown.splitlines() if line.startswith("fdr:")]
    return line


def test_status_metrics_and_inferctl_show_what_the_recorder_keeps(
    daemon_factory: DaemonFactory, short_tmp_path: Path
) -> None:
    fdr_dir = short_tmp_path / "fdr"
    earlier_run(fdr_dir, 6)  # 6 KiB: over the cap, so the first segment opened deletes
    daemon = daemon_factory(
        fdr={"directory": str(fdr_dir), "segment_max_bytes": SEGMENT, "max_total_bytes": 4096},
        metrics={"listen": "127.0.0.1:0"},
    )
    with OperatorClient(daemon.control, timeout=10) as operator:
        listen = operator.status()["metrics"]["listen"]

        def settled() -> Seen | None:
            """What status, the disk, a scrape and inferctl say, when nothing was
            written between the first status and the last (else None: try again)."""
            before = operator.status()["fdr"]
            disk = list_segments(fdr_dir)
            disk_bytes = sum(path.lstat().st_size for path in disk)
            samples, line = scrape(listen), inferctl_fdr_line(daemon.control)
            after = operator.status()["fdr"]
            if before != after or after["queue_depth"]:
                return None
            # A scrape within 1 s of the last collection is served from it (DESIGN
            # 327): one that predates a record written meanwhile is tried again; the
            # wait fails if the endpoint never shows what status says.
            if (samples["inferd_fdr_segments_kept"], samples["inferd_fdr_kept_bytes"]) != (
                after["segments_kept"],
                after["bytes_kept"],
            ):
                return None
            return Seen(after, disk, disk_bytes, samples, line)

        fdr, disk, disk_bytes, samples, shown = wait_until(settled, message="the recorder idle")

    assert_valid(FDR_SCHEMA, fdr)
    assert_invalid(FDR_SCHEMA, {key: v for key, v in fdr.items() if key != "bytes_kept"})
    assert fdr["segments_deleted"] >= 3 and fdr["last_error"] is None  # the cap deleted
    assert fdr["segments_kept"] == len(disk) >= 1
    assert fdr["bytes_kept"] == disk_bytes <= fdr["max_total_bytes"] == 4096
    assert fdr["oldest_segment"] == disk[0].name > framing.segment_name(3)
    assert samples["inferd_fdr_segments_kept"] == fdr["segments_kept"]
    assert samples["inferd_fdr_kept_bytes"] == fdr["bytes_kept"]
    assert samples["inferd_fdr_max_total_bytes"] == 4096
    kept = re.search(r", (\d+) segments? (.+) of 4\.0 KiB kept", shown)
    assert kept is not None, shown
    assert (int(kept.group(1)), kept.group(2)) == (fdr["segments_kept"], size(fdr["bytes_kept"]))
