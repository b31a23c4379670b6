"""Flight data recorder throughput: sustained records/s, group commit and producer latency.

One run measures ``FlightRecorder`` (``inferd.fdr.writer``) with its default
queue (``queue_capacity`` 4096) in two modes, each against a fresh recorder in
a temporary directory:

``flood``
    One thread calls ``record()`` as fast as it can for the row's time; the
    queue overflows and drops are expected (and counted).  ``rec/s`` is the
    records on disk divided by the wall time from the first call until
    ``wait_durable`` returns; ``live_rec/s`` counts only what the writer wrote
    while the producer was still running (the rest was drained afterwards).
``paced``
    The same thread calls ``record()`` at ``--rate`` records/s (sleeping in
    between), as the daemon would; drops must be 0.  A poller thread reads
    ``durable_seq`` every ``--poll-ms``; a record's lag is the first time the
    poller saw ``durable_seq >= seq`` minus the ``mono_ns`` that ``record()``
    stamped on it (read back from the segments).

Rows: (a) ``deadline_miss`` (not critical) at the default
``fsync_interval_ms`` 100, (b) the same at 10 and 1000 ms, (c)
``daemon_lifecycle`` (critical: synced at once), (d) 1 % critical, 99 %
deadline_miss.  Rows are interleaved over ``--rounds`` rounds, the order
rotated each round, so load from other processes hits all of them alike.
Under the table: the same disk without the recorder (pre-encoded frames, and
encode-and-write on one thread), as the ceiling the writer could reach.

Run from the repository root: ``.venv/bin/python bench/fdr_throughput.py [--json]``.

``--rotation`` measures instead what one rotation costs against the number of
segments the size cap keeps (``--kept``, default 1024,4096,32768; 1 KiB segments,
one record each): the time in ``FlightRecorder._open_segment`` (the cap's
deletions, then the new segment's create and syncs), ``record()`` to
``wait_durable``, and ``start()`` (the one scan of the directory).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from inferd.config import FdrConfig
from inferd.fdr import framing
from inferd.fdr.reader import ReadReport, read_records
from inferd.fdr.writer import FlightRecorder
from inferd.process_identity import read_boot_id
from inferd.supervision.logging import configure_logging

NONCRITICAL = ("deadline_miss", {"model": "demo", "count": 3, "window_s": 1.0})
# What Daemon._lifecycle records.
CRITICAL = (
    "daemon_lifecycle",
    {
        "event": "ready",
        "version": "0.1.0",
        "config_fingerprint": "3f9a0c1d2e4b5a69",
        "pid": 4242,
        "state": "ready",
    },
)
BENCH_KINDS = (NONCRITICAL[0], CRITICAL[0])
MODES = ("flood", "paced")


@dataclass(frozen=True)
class Case:
    row: str
    config: str
    fsync_interval_ms: int
    #: One record in ``critical_every`` is critical (0: none, 1: all).
    critical_every: int

    def pattern(self) -> list[tuple[str, dict[str, Any]]]:
        if self.critical_every == 0:
            return [NONCRITICAL]
        if self.critical_every == 1:
            return [CRITICAL]
        return [NONCRITICAL] * (self.critical_every - 1) + [CRITICAL]


CASES = (
    Case("a", "deadline_miss fsync=100ms", 100, 0),
    Case("b", "deadline_miss fsync=10ms", 10, 0),
    Case("b", "deadline_miss fsync=1000ms", 1000, 0),
    Case("c", "lifecycle (critical)", 100, 1),
    Case("d", "mix 1% critical fsync=100", 100, 100),
)


@dataclass
class Totals:
    """One (mode, case) row, summed over the rounds."""

    mode: str
    case: Case
    offered: int = 0
    written: int = 0
    extra_frames: int = 0
    dropped: int = 0
    bytes_written: int = 0
    syncs: int = 0
    produce_ns: int = 0
    wall_ns: int = 0
    written_while_producing: int = 0
    call_ns: list[int] = field(default_factory=list)
    lag_ns: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class DurablePoller(threading.Thread):
    """Samples ``recorder.durable_seq``: (monotonic ns, value) at every change."""

    def __init__(self, recorder: FlightRecorder, interval_s: float) -> None:
        super().__init__(name="fdr-bench-poller", daemon=True)
        self._recorder = recorder
        self._interval_s = interval_s
        self._stop_event = threading.Event()
        self.times: list[int] = []
        self.seqs: list[int] = []

    def _sample(self) -> None:
        seq = self._recorder.durable_seq
        if not self.seqs or seq != self.seqs[-1]:
            self.times.append(time.monotonic_ns())
            self.seqs.append(seq)

    def run(self) -> None:
        while not self._stop_event.is_set():
            self._sample()
            time.sleep(self._interval_s)

    def finish(self) -> None:
        self._stop_event.set()
        self.join()
        self._sample()

    def durable_at(self, seq: int) -> int | None:
        index = bisect.bisect_left(self.seqs, seq)
        return self.times[index] if index < len(self.seqs) else None


def measure(totals: Totals, directory: Path, seconds: float, rate: float, poll_s: float) -> None:
    case = totals.case
    pattern = case.pattern()
    period = len(pattern)
    recorder = FlightRecorder(
        FdrConfig(directory=directory, fsync_interval_ms=case.fsync_interval_ms)
    )
    recorder.start()
    poller = DurablePoller(recorder, poll_s) if totals.mode == "paced" else None
    if poller is not None:
        poller.start()
    record = recorder.record
    clock = time.perf_counter_ns
    mono = time.monotonic_ns
    calls = totals.call_ns
    offered = 0
    try:
        start = mono()
        end = start + int(seconds * 1e9)
        if totals.mode == "flood":
            while mono() < end:
                kind, payload = pattern[offered % period]
                before = clock()
                record(kind, payload)
                calls.append(clock() - before)
                offered += 1
        else:
            step = 1e9 / rate
            while True:
                due = start + int(offered * step)
                now = mono()
                if due >= end:
                    break
                if now < due:
                    time.sleep((due - now) / 1e9)
                    continue
                kind, payload = pattern[offered % period]
                before = clock()
                record(kind, payload)
                calls.append(clock() - before)
                offered += 1
        stopped = mono()
        written_while_producing = recorder.records_written
        if not recorder.wait_durable(60.0):
            totals.failures.append(f"{totals.mode}/{case.config}: wait_durable timed out")
        durable = mono()
        status = recorder.status()
    finally:
        if poller is not None:
            poller.finish()
        recorder.stop()

    report = ReadReport()
    on_disk = {
        record.seq: record.mono_ns
        for record in read_records(directory, report)
        if record.kind in BENCH_KINDS
    }
    if report.is_corrupt:
        totals.failures.append(f"{totals.mode}/{case.config}: read-back found damage")
    if status["last_error"]:
        totals.failures.append(f"{totals.mode}/{case.config}: {status['last_error']}")
    if offered != len(on_disk) + status["records_dropped"]:
        totals.failures.append(
            f"{totals.mode}/{case.config}: offered {offered} != on disk {len(on_disk)} "
            f"+ dropped {status['records_dropped']}"
        )
    if poller is not None:
        for seq, stamped in on_disk.items():
            seen = poller.durable_at(seq)
            totals.lag_ns.append((seen if seen is not None else durable) - stamped)

    totals.offered += offered
    totals.written += len(on_disk)
    totals.extra_frames += status["records_written"] - len(on_disk)
    totals.dropped += status["records_dropped"]
    totals.bytes_written += status["bytes_written"]
    totals.syncs += status["syncs"]
    totals.produce_ns += stopped - start
    totals.wall_ns += durable - start
    # A fresh directory numbers frames 1, 2, ...: those the writer had written
    # when the producer stopped have seq <= written_while_producing.
    totals.written_while_producing += sum(1 for seq in on_disk if seq <= written_while_producing)


# -- the disk without the recorder ---------------------------------------------------
def sample_frame(seq: int = 1) -> bytes:
    kind, payload = NONCRITICAL
    body = framing.encode_body(
        {
            "kind": kind,
            "schema_version": 1,
            "seq": seq,
            "wall_ns": time.time_ns(),
            "mono_ns": time.monotonic_ns(),
            "boot_id": read_boot_id(),
            "payload": payload,
        }
    )
    return framing.encode_frame(body)


def disk_reference(directory: Path, records: int, sync_samples: int) -> dict[str, Any]:
    """What one thread reaches on this disk with no queue and no other thread."""
    directory.mkdir()
    frame = sample_frame()
    boot_id = read_boot_id()
    kind, payload = NONCRITICAL

    def run_writer(path: Path, make_batch: Callable[[int], bytes]) -> float:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        try:
            start = time.monotonic()
            last_sync = start
            done = 0
            while done < records:
                count = min(256, records - done)
                data = make_batch(count)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                done += count
                if time.monotonic() - last_sync >= 0.1:
                    os.fdatasync(fd)
                    last_sync = time.monotonic()
            os.fdatasync(fd)
            return time.monotonic() - start
        finally:
            os.close(fd)
            path.unlink()

    raw_s = run_writer(directory / "raw", lambda count: frame * count)

    seq = 0

    def encoded(count: int) -> bytes:
        nonlocal seq
        frames = []
        for _ in range(count):
            seq += 1
            body = framing.encode_body(
                {
                    "kind": kind,
                    "schema_version": 1,
                    "seq": seq,
                    "wall_ns": time.time_ns(),
                    "mono_ns": time.monotonic_ns(),
                    "boot_id": boot_id,
                    "payload": dict(payload),
                }
            )
            frames.append(framing.encode_frame(body))
        return b"".join(frames)

    encode_s = run_writer(directory / "encoded", encoded)

    path = directory / "sync"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    sync_ns: list[int] = []
    try:
        for _ in range(sync_samples):
            before = time.perf_counter_ns()
            os.write(fd, frame)
            os.fdatasync(fd)
            sync_ns.append(time.perf_counter_ns() - before)
    finally:
        os.close(fd)
        path.unlink()
    sync_ns.sort()
    return {
        "frame_bytes": len(frame),
        "records": records,
        "preencoded_records_per_s": records / raw_s,
        "preencoded_mb_per_s": records * len(frame) / raw_s / 1e6,
        "encode_and_write_records_per_s": records / encode_s,
        "write_fdatasync_one_frame_p50_ms": percentile(sync_ns, 50) / 1e6,
        "write_fdatasync_one_frame_p99_ms": percentile(sync_ns, 99) / 1e6,
    }


# -- rotation cost against the number of kept segments (--rotation) -------------------
ROTATION_KEPT = (1024, 4096, 32768)
#: The smallest segment (``FDR_SEGMENT_MIN_BYTES``): the most segments per byte kept.
ROTATION_SEGMENT_BYTES = 1024
#: A ~600-byte frame: one record per 1 KiB segment, so each record opens a segment.
ROTATION_RECORD = ("deadline_miss", {"model": "m" * 450, "count": 1, "window_s": 1.0})


class TimedRecorder(FlightRecorder):
    """Times each ``_open_segment``: the size cap's deletions, then the new segment's
    create, ``fdatasync`` and directory fsync (what a rotation does on the writer thread)."""

    def __init__(self, config: FdrConfig) -> None:
        super().__init__(config)
        self.open_ns: list[int] = []

    def _open_segment(self) -> Any:
        before = time.perf_counter_ns()
        try:
            return super()._open_segment()
        finally:
            self.open_ns.append(time.perf_counter_ns() - before)


def fill_with_segments(directory: Path, count: int) -> None:
    """``count`` segments: ``count - 1`` sparse files of ``ROTATION_SEGMENT_BYTES`` (the
    cap counts their size and never reads them), then a real one holding seq 1, which
    the recorder's start reads to resume."""
    directory.mkdir(mode=0o750)
    for index in range(1, count):
        fd = os.open(directory / framing.segment_name(index), os.O_WRONLY | os.O_CREAT, 0o640)
        try:
            os.ftruncate(fd, ROTATION_SEGMENT_BYTES)
        finally:
            os.close(fd)
    header = framing.encode_segment_header(count, time.time_ns())
    (directory / framing.segment_name(count)).write_bytes(header + sample_frame(1))


def measure_rotation(directory: Path, kept: int, rotations: int) -> dict[str, Any]:
    fill_with_segments(directory, kept)
    config = FdrConfig(
        directory=directory,
        segment_max_bytes=ROTATION_SEGMENT_BYTES,
        # What the cap keeps after each rotation: ``kept`` segments of 1 KiB.
        max_total_bytes=(kept + 1) * ROTATION_SEGMENT_BYTES,
    )
    recorder = TimedRecorder(config)
    started = time.perf_counter_ns()
    recorder.start()
    start_ns = time.perf_counter_ns() - started
    stalls: list[int] = []
    failures: list[str] = []
    try:
        kind, payload = ROTATION_RECORD
        for _ in range(rotations + 1):
            before = time.perf_counter_ns()
            recorder.record(kind, payload)
            if not recorder.wait_durable(60.0):
                failures.append(f"rotation/{kept}: wait_durable failed")
            stalls.append(time.perf_counter_ns() - before)
        status = recorder.status()
    finally:
        recorder.stop()
    if status["last_error"] or status["records_dropped"]:
        failures.append(f"rotation/{kept}: {status['last_error']}, {status['records_dropped']}")
    left = sum(1 for name in os.listdir(directory) if framing.segment_index(name) is not None)
    opens = sorted(recorder.open_ns[1:])  # the first opens at start, into a directory as filled
    durable = sorted(stalls[1:])
    return {
        "kept": kept,
        "segments_after": left,
        "segments_deleted": status["segments_deleted"],
        "rotations": len(opens),
        "start_ms": start_ns / 1e6,
        "rotation_p50_ms": percentile(opens, 50) / 1e6,
        "rotation_p99_ms": percentile(opens, 99) / 1e6,
        "rotation_max_ms": (opens[-1] / 1e6) if opens else math.nan,
        "record_durable_p50_ms": percentile(durable, 50) / 1e6,
        "record_durable_max_ms": (durable[-1] / 1e6) if durable else math.nan,
        "failures": failures,
    }


def run_rotation(kept: list[int], rotations: int, base: Path | None) -> dict[str, Any]:
    configure_logging("info", "json")
    root = Path(tempfile.mkdtemp(prefix="fdr-bench-rotation-", dir=base))
    rows = []
    # Left open: the logging's exit hook reports the lines it held back (one
    # ``fdr_segments_deleted`` per rotation is rate-limited) to the same file.
    devnull = open(os.devnull, "w")  # noqa: SIM115
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=devnull))
    try:
        for count in kept:
            rows.append(measure_rotation(root / f"kept-{count}", count, rotations))
            shutil.rmtree(root / f"kept-{count}")
        filesystem = filesystem_of(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "params": {"rotations": rotations, "segment_max_bytes": ROTATION_SEGMENT_BYTES},
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0],
        },
        "filesystem": filesystem,
        "rows": rows,
        "failures": [failure for row in rows for failure in row.pop("failures")],
    }


def print_rotation_table(result: dict[str, Any]) -> None:
    header = (
        f"{'kept':>7}{'after':>7}{'deleted':>8}{'rotations':>10}{'start_ms':>10}"
        f"{'rot_p50_ms':>11}{'rot_p99_ms':>11}{'rot_max_ms':>11}"
        f"{'durable_p50_ms':>15}{'durable_max_ms':>15}"
    )
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        print(
            f"{row['kept']:>7}{row['segments_after']:>7}{row['segments_deleted']:>8}"
            f"{row['rotations']:>10}{row['start_ms']:>10.1f}{row['rotation_p50_ms']:>11.2f}"
            f"{row['rotation_p99_ms']:>11.2f}{row['rotation_max_ms']:>11.2f}"
            f"{row['record_durable_p50_ms']:>15.2f}{row['record_durable_max_ms']:>15.2f}"
        )
    fs, m = result["filesystem"], result["machine"]
    print(
        f"\n{result['params']['segment_max_bytes']}-byte segments, one record each; rot_* = "
        "FlightRecorder._open_segment (the size cap's deletions, then the new segment's "
        "create and syncs); durable_* = record() .. wait_durable returned; start_ms = start()."
    )
    print(
        f"temp dir on {fs['device']} ({fs['type']}); {m['cpus']} CPUs ({m['cpu_model']}), "
        f"Python {m['python']}, 1-min load average at the end {m['load_average_1m']:.2f}."
    )
    for failure in result["failures"]:
        print(f"FAILURE: {failure}")


# -- reporting -------------------------------------------------------------------------
def percentile(sorted_values: list[int], p: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def filesystem_of(path: Path) -> dict[str, str]:
    """The /proc/mounts entry whose mount point is the longest prefix of ``path``."""
    resolved = str(path.resolve())
    best = {"mount_point": "?", "device": "?", "type": "?", "options": "?"}
    best_len = -1
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        device, mount_point, fstype, options = fields[:4]
        mount_point = mount_point.replace("\\040", " ")
        inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best_len:
            best_len = len(mount_point)
            best = {
                "mount_point": mount_point,
                "device": device,
                "type": fstype,
                "options": options,
            }
    return best


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def row_result(totals: Totals, baseline: Totals) -> dict[str, Any]:
    wall_s = totals.wall_ns / 1e9
    rate = totals.written / wall_s if wall_s else 0.0
    base_wall_s = baseline.wall_ns / 1e9
    base_rate = baseline.written / base_wall_s if base_wall_s else 0.0
    calls = sorted(totals.call_ns)
    lags = sorted(totals.lag_ns)
    return {
        "mode": totals.mode,
        "row": totals.case.row,
        "config": totals.case.config,
        "fsync_interval_ms": totals.case.fsync_interval_ms,
        "critical_every": totals.case.critical_every,
        "offered": totals.offered,
        "written": totals.written,
        "dropped": totals.dropped,
        "drop_report_frames": totals.extra_frames,
        "records_per_s": rate,
        "ratio_to_a": rate / base_rate if base_rate else math.nan,
        "live_records_per_s": totals.written_while_producing / (totals.produce_ns / 1e9),
        "mb_per_s": totals.bytes_written / wall_s / 1e6 if wall_s else 0.0,
        "syncs": totals.syncs,
        "records_per_sync": totals.written / totals.syncs if totals.syncs else math.nan,
        "produce_s": totals.produce_ns / 1e9,
        "wall_s": wall_s,
        "call_p50_us": percentile(calls, 50) / 1e3,
        "call_p99_us": percentile(calls, 99) / 1e3,
        "call_max_us": (calls[-1] / 1e3) if calls else math.nan,
        "lag_p50_ms": percentile(lags, 50) / 1e6,
        "lag_p99_ms": percentile(lags, 99) / 1e6,
        "lag_max_ms": (lags[-1] / 1e6) if lags else math.nan,
    }


def print_table(result: dict[str, Any]) -> None:
    header = (
        f"{'mode':<6}{'row':<4}{'config':<27}{'offered':>8}{'written':>8}{'dropped':>8}"
        f"{'rec/s':>9}{'x(a)':>6}{'live_rec/s':>11}{'MB/s':>6}{'syncs':>6}{'rec/sync':>9}"
        f"{'call_p50_us':>12}{'call_p99_us':>12}{'call_max_us':>12}"
        f"{'lag_p50_ms':>11}{'lag_p99_ms':>11}"
    )
    print(header)
    print("-" * len(header))

    def lag(value: float) -> str:
        return f"{'-':>11}" if math.isnan(value) else f"{value:>11.1f}"

    previous_mode = None
    for row in result["rows"]:
        if previous_mode is not None and row["mode"] != previous_mode:
            print()
        previous_mode = row["mode"]
        print(
            f"{row['mode']:<6}{row['row']:<4}{row['config']:<27}{row['offered']:>8}"
            f"{row['written']:>8}{row['dropped']:>8}{row['records_per_s']:>9.0f}"
            f"{row['ratio_to_a']:>6.2f}{row['live_records_per_s']:>11.0f}"
            f"{row['mb_per_s']:>6.2f}{row['syncs']:>6}{row['records_per_sync']:>9.1f}"
            f"{row['call_p50_us']:>12.1f}{row['call_p99_us']:>12.1f}{row['call_max_us']:>12.0f}"
            f"{lag(row['lag_p50_ms'])}{lag(row['lag_p99_ms'])}"
        )
    p = result["params"]
    ref = result["disk_reference"]
    fs = result["filesystem"]
    m = result["machine"]
    print(
        f"\n{p['seconds']:g} s per row in {p['rounds']} interleaved rounds; queue_capacity "
        f"{p['queue_capacity']}; paced at {p['rate']:g} records/s, durable_seq polled every "
        f"{p['poll_ms']:g} ms."
    )
    print(
        "rec/s = records on disk / (first record() .. wait_durable returned); x(a) = rec/s / "
        "row a's of the same mode; live_rec/s = written while the producer ran / its time; "
        "rec/sync = records / fdatasyncs; call_* = one record() call (producer side); "
        "lag = record() -> durable_seq covers it."
    )
    paced_drops = sum(r["dropped"] for r in result["rows"] if r["mode"] == "paced")
    print(f"paced rows dropped {paced_drops} records ({'OK' if paced_drops == 0 else 'FAIL'}).")
    print(
        f"disk without the recorder (one thread, {ref['frame_bytes']}-byte frames, 256 per "
        f"os.write, fdatasync every 100 ms): pre-encoded {ref['preencoded_records_per_s']:.0f} "
        f"rec/s ({ref['preencoded_mb_per_s']:.0f} MB/s); encoded in Python "
        f"{ref['encode_and_write_records_per_s']:.0f} rec/s; write + fdatasync of one frame "
        f"p50 {ref['write_fdatasync_one_frame_p50_ms']:.2f} ms, "
        f"p99 {ref['write_fdatasync_one_frame_p99_ms']:.2f} ms."
    )
    print(
        f"temp dir on {fs['device']} ({fs['type']}, mounted on {fs['mount_point']}, "
        f"{fs['options']}); {m['cpus']} CPUs ({m['cpu_model']}), Python {m['python']}, "
        f"switch interval {m['switch_interval_ms']:g} ms, 1-min load average at the end "
        f"{m['load_average_1m']:.2f}."
    )
    for failure in result["failures"]:
        print(f"FAILURE: {failure}")


def run(
    seconds: float, rounds: int, rate: float, poll_ms: float, base: Path | None
) -> dict[str, Any]:
    # The daemon's JSON logging at its default level (the recorder logs every
    # 1000th drop), written nowhere so the table stays readable.
    configure_logging("info", "json")
    # Left open: the logging's exit hook reports the lines it held back there
    # (a closed file ended the run with a traceback after the table).
    devnull = open(os.devnull, "w")  # noqa: SIM115
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=devnull))
    return _run(seconds, rounds, rate, poll_ms, base)


def _run(
    seconds: float, rounds: int, rate: float, poll_ms: float, base: Path | None
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="fdr-bench-", dir=base))
    totals = {(mode, case): Totals(mode, case) for mode in MODES for case in CASES}
    try:
        # Warm-up: imports (google_crc32c is imported on first use) and first segment.
        measure(Totals("flood", CASES[0]), root / "warmup", 0.1, rate, poll_ms / 1000)
        shutil.rmtree(root / "warmup")

        keys = list(totals)
        per_round = seconds / rounds
        for round_index in range(rounds):
            shift = (round_index * 3) % len(keys)
            for n, key in enumerate(keys[shift:] + keys[:shift]):
                directory = root / f"r{round_index}-{n}"
                measure(totals[key], directory, per_round, rate, poll_ms / 1000)
                shutil.rmtree(directory)
        reference = disk_reference(root / "reference", records=200_000, sync_samples=200)
        filesystem = filesystem_of(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows: list[dict[str, Any]] = []
    for mode in MODES:
        baseline = totals[(mode, CASES[0])]
        rows.extend(row_result(totals[(mode, case)], baseline) for case in CASES)
    return {
        "params": {
            "seconds": seconds,
            "rounds": rounds,
            "rate": rate,
            "poll_ms": poll_ms,
            "queue_capacity": FdrConfig(directory=root).queue_capacity,
            "temp_dir": str(root),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "python": platform.python_version(),
            "switch_interval_ms": sys.getswitchinterval() * 1000,
            "load_average_1m": os.getloadavg()[0],
        },
        "filesystem": filesystem,
        "rows": rows,
        "disk_reference": reference,
        "failures": [f for t in totals.values() for f in t.failures],
    }


def json_safe(value: Any) -> Any:
    """NaN (a statistic with no samples) as null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="producer time per row, all rounds (default 2)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="interleaved rounds the time is split into (default 2)",
    )
    parser.add_argument(
        "--rate", type=float, default=1000.0, help="paced mode: records/s offered (default 1000)"
    )
    parser.add_argument(
        "--poll-ms",
        type=float,
        default=0.5,
        help="paced mode: durable_seq poll period (default 0.5)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to make the temp dir (default: $TMPDIR or /tmp)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--rotation",
        action="store_true",
        help="instead: the time of one rotation against the number of segments kept",
    )
    parser.add_argument(
        "--kept",
        type=lambda text: [int(n) for n in text.split(",")],
        default=list(ROTATION_KEPT),
        help="--rotation: segments kept, comma-separated (default 1024,4096,32768)",
    )
    parser.add_argument(
        "--rotations", type=int, default=20, help="--rotation: rotations timed each (default 20)"
    )
    args = parser.parse_args(argv)
    if args.rotation:
        if args.rotations < 1 or min(args.kept) < 2:
            parser.error("--rotations must be >= 1 and each --kept >= 2")
        rotation = run_rotation(args.kept, args.rotations, args.dir)
        return report(rotation, args.json, print_rotation_table)
    if args.seconds <= 0 or args.rounds < 1 or args.rate <= 0 or args.poll_ms <= 0:
        parser.error("--seconds, --rate and --poll-ms must be > 0, --rounds >= 1")
    result = run(args.seconds, args.rounds, args.rate, args.poll_ms, args.dir)
    return report(result, args.json, print_table)


def report(result: dict[str, Any], as_json: bool, table: Callable[[dict[str, Any]], None]) -> int:
    """Print ``result`` as JSON or as its ``table``: exit 1 if any of its runs failed."""
    if as_json:
        json.dump(json_safe(result), sys.stdout, indent=2)
        print()
    else:
        table(result)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
