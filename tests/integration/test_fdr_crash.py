"""A recorder whose writer process is SIGKILLed mid-stream reads back intact."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from inferd.fdr.reader import ReadReport, read_records

WRITER = textwrap.dedent(
    """
    import sys
    import time
    from pathlib import Path
    from inferd.config import FdrConfig
    from inferd.fdr.writer import FlightRecorder

    fdr = FlightRecorder(FdrConfig(directory=Path(sys.argv[1]), fsync_interval_ms=5,
                                   segment_max_bytes=64 * 1024, max_total_bytes=1 << 30))
    fdr.start()
    count = 0
    while True:
        count += 1
        if count % 10 == 0:
            fdr.record("daemon_lifecycle", {"event": "ready", "version": str(count),
                                               "config_fingerprint": "f", "pid": 1})
        else:
            fdr.record("deadline_miss", {"model": "m" * (count % 50), "count": count,
                                            "window_s": 1.0})
        if count % 200 == 0:
            print("durable", fdr.status()["durable_seq"], flush=True)
            time.sleep(0.002)  # keep the producer near the disk's pace
    """
)


def test_sigkill_mid_stream_keeps_every_synced_record(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    durable = 0
    give_up = time.monotonic() + 30
    while durable < 3000 and time.monotonic() < give_up:
        line = process.stdout.readline()
        assert line, "writer exited early"
        if line.startswith("durable "):
            durable = max(durable, int(line.split()[1]))
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    assert durable >= 3000, "the writer never made 3000 records durable"

    report = ReadReport()
    records = list(read_records(tmp_path, report))
    seqs = [record.seq for record in records]
    assert seqs == list(range(1, len(seqs) + 1)), "records come back in order, without gaps"
    assert len(seqs) >= durable, "every record reported durable before the kill reads back"
    assert not report.is_corrupt, report.as_dict()
    assert len(report.torn_tails) <= 1
    for record in records:  # every body is intact, whatever was dropped under load
        if record.kind == "deadline_miss":
            count = record.payload["count"]
            assert count % 10 != 0 and record.payload["model"] == "m" * (count % 50)
        elif record.kind == "daemon_lifecycle":
            assert int(record.payload["version"]) % 10 == 0
        else:
            assert record.kind == "fdr_dropped"

    result = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "fdr", "verify", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("OK")
