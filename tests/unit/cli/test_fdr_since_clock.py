"""``inferd fdr dump --since`` compares wall clocks, which a boot may set after its first
records (no RTC: 1970 at boot, or the time systemd-timesyncd saved at the last shutdown;
then NTP or GPS).  Such a record of this flight is older than any ``--since`` and was
left out without a word (review R4, F5).  Now stderr says how many records of the boots
it shows it left out; a bound on the stamp (a first fix, 2020) missed the saved-time case
(review R5, F5), so the rule is by boot."""

from __future__ import annotations

import io
import time
from pathlib import Path

from inferd.cli.fdr import dump, parse_since
from inferd.fdr.writer import FlightRecorder
from tests.unit.fdr.test_fdr import config, miss

HOUR_NS = 3600 * 10**9


def _recorded(directory: Path, wall_ns: int, seq: int, boot_id: str) -> None:
    fdr = FlightRecorder(config(directory), wall_clock=lambda: wall_ns, boot_id=boot_id)
    fdr.start()
    fdr.record("deadline_miss", miss(seq))
    assert fdr.wait_durable(5)
    fdr.stop()


def _dumped(directory: Path, since: str | None) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    since_ns = parse_since(since) if since else None
    assert dump(directory, kinds=[], since_wall_ns=since_ns, as_json=True, out=out, err=err) == 0
    return len(out.getvalue().splitlines()), err.getvalue()


def test_since_says_what_it_left_out_of_the_boots_it_shows(tmp_path: Path) -> None:
    now = time.time_ns()
    _recorded(tmp_path, now - 30 * 24 * HOUR_NS, 1, "last-month")  # another boot: silent
    _recorded(tmp_path, 95 * 10**9, 2, "this-boot")  # 1970: the clock not set yet
    _recorded(tmp_path, now - 72 * HOUR_NS, 3, "this-boot")  # the time saved at shutdown
    _recorded(tmp_path, now, 4, "this-boot")  # the clock set
    shown, said = _dumped(tmp_path, "2h")
    assert shown == 1
    assert "--since left out 2 earlier record(s) of the boot(s) it shows" in said
    assert _dumped(tmp_path, None) == (4, "")  # without --since: all, nothing to say


def test_since_speaks_of_a_last_flight_stamped_before_its_clock_was_ever_set(
    tmp_path: Path,
) -> None:
    """A flight with no RTC, GPS time or network: every record stamped 1970, so
    ``--since`` shows none of its boot; it is the recording's last boot, said (review
    R6, F3: the per-boot rule of its first fix was silent)."""
    _recorded(tmp_path, time.time_ns() - 30 * 24 * HOUR_NS, 1, "last-month")
    _recorded(tmp_path, 95 * 10**9, 2, "this-flight")
    _recorded(tmp_path, 96 * 10**9, 3, "this-flight")
    shown, said = _dumped(tmp_path, "2h")
    assert shown == 0 and "--since left out 2 earlier record(s)" in said


def test_since_with_kinds_speaks_only_of_the_last_boot_recorded(tmp_path: Path) -> None:
    """``--kind``: the last boot is the recording's, not the last with a record of that
    kind: a month-old boot's record, rightly outside the window, is not said (R7, F2)."""
    _recorded(tmp_path, time.time_ns() - 30 * 24 * HOUR_NS, 1, "last-month")
    fdr = FlightRecorder(config(tmp_path), boot_id="now")
    fdr.start()
    fallback = {"model": "m", "configured_runtime": "tensorrt", "reason": "missing"}
    fdr.record("fallback_to_onnx_trt_ep", {**fallback, "active_providers": ["CPU"]})
    assert fdr.wait_durable(5)
    fdr.stop()
    out, err = io.StringIO(), io.StringIO()
    since = parse_since("2h")
    dump(tmp_path, kinds=["deadline_miss"], since_wall_ns=since, as_json=True, out=out, err=err)
    assert (out.getvalue(), err.getvalue()) == ("", "")
