"""``inferd selftest --work-dir DIR`` where DIR cannot be made (its parent is a
file): a usage error, exit 2 with one line naming the option, before any check runs
and without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_a_work_dir_that_cannot_be_made_is_a_usage_error(short_tmp_path: Path) -> None:
    parent = short_tmp_path / "a-file"
    parent.write_text("not a directory\n")
    done = subprocess.run(
        [sys.executable, "-m", "inferd.cli", "selftest", "--json", "--work-dir", str(parent / "w")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"inferd selftest: --work-dir {parent / 'w'} cannot be made")
    assert done.stdout == ""
