"""``inferd fdr dump --since`` compares wall clocks: a record this flight wrote before
its clock was set (1970 at boot, no RTC) is older than any ``--since`` and was left out
without a word (review R4, F5: ``dump`` showed it, ``dump --since 2h`` did not, exit 0,
nothing on stderr).  Now stderr says how many such records it left out."""

from __future__ import annotations

import io
import time
from pathlib import Path

from inferd.cli.fdr import dump, parse_since
from inferd.fdr.writer import FlightRecorder
from tests.unit.fdr.test_fdr import config, miss


def _recorded(directory: Path, wall_ns: int, seq: int) -> None:
    fdr = FlightRecorder(config(directory), wall_clock=lambda: wall_ns, boot_id="b")
    fdr.start()
    fdr.record("deadline_miss", miss(seq))
    assert fdr.wait_durable(5)
    fdr.stop()


def test_since_says_what_it_left_out_from_before_the_clock_was_set(tmp_path: Path) -> None:
    _recorded(tmp_path, 95 * 10**9, 1)  # 1970-01-01T00:01:35: the clock not set yet
    _recorded(tmp_path, time.time_ns(), 2)
    out, err = io.StringIO(), io.StringIO()
    since = parse_since("2h")
    assert dump(tmp_path, kinds=[], since_wall_ns=since, as_json=True, out=out, err=err) == 0
    assert len(out.getvalue().splitlines()) == 1  # this hour's record only
    assert "--since left out 1 record(s) stamped before 2020" in err.getvalue()
    quiet = io.StringIO()
    dump(tmp_path, kinds=[], since_wall_ns=None, as_json=True, out=io.StringIO(), err=quiet)
    assert quiet.getvalue() == ""  # without --since both are shown, nothing to say
