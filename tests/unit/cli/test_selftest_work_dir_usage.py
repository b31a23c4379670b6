"""``inferd selftest --work-dir DIR`` where DIR cannot be made (its parent is a
file): a usage error, exit 2 with one line naming the option, before any check runs
and without a traceback."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_inferd_cli_promises import inferd


def test_a_work_dir_that_cannot_be_made_is_a_usage_error(short_tmp_path: Path) -> None:
    parent = short_tmp_path / "a-file"
    parent.write_text("not a directory\n")
    done = inferd("selftest", "--json", "--work-dir", str(parent / "w"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"inferd selftest: --work-dir {parent / 'w'} cannot be created")
    assert done.stdout == ""
