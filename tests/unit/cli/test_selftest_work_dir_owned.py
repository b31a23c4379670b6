"""``inferd selftest --work-dir DIR`` refuses a directory that is not this user's own
(``inferd.owned_files.ensure_owned_dir``): the checks write engines, builds and daemon
configs in subdirectories of it, which another user who may write it (or a directory
above it) could swap for their own.  Refused as a usage error (exit 2, one line naming
the problem) before any check runs and before anything is written there; an absent
or empty directory of this user's is still accepted."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from inferd.cli import selftest as selftest_cli
from inferd.errors import UnsafeDirectoryError
from inferd.selftest.runner import run_selftest
from tests.conftest import OtherUser


def run_no_checks(work_dir: Path) -> tuple[int, str]:
    """The CLI's run with no checks: what it says of ``work_dir`` alone (before the
    fix an unsafe directory was accepted and the run exited 0)."""
    out, err = io.StringIO(), io.StringIO()
    code = selftest_cli.run(as_json=True, work_dir=work_dir, out=out, err=err, checks=())
    return code, err.getvalue()


def test_a_work_dir_others_may_write_is_refused_before_anything_is_written(
    short_tmp_path: Path,
) -> None:
    shared = short_tmp_path / "inferd-selftest"
    shared.mkdir()
    shared.chmod(0o777)  # as a `mkdir /tmp/inferd-selftest` under umask 0 leaves it
    code, err = run_no_checks(shared)
    assert code == 2, err
    assert err == (
        f"inferd selftest: --work-dir {shared} is writable by its group and others "
        "(mode 0777): another user could replace what the self-test writes there; give "
        f"a directory only uid {os.geteuid()} may write, inside directories only it or "
        "root may write (chown, chmod go-w), or leave --work-dir out (a private "
        "temporary directory)\n"
    )
    assert list(shared.iterdir()) == []
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777  # refused, not "fixed"


def test_a_work_dir_another_user_owns_is_refused(
    short_tmp_path: Path, other_user: OtherUser
) -> None:
    theirs = short_tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, other_user.uid, other_user.gid)
    code, err = run_no_checks(theirs)
    assert code == 2, err
    assert f"--work-dir {theirs} is owned by uid {other_user.uid}, not by uid " in err
    assert list(theirs.iterdir()) == []


def test_a_new_work_dir_inside_a_directory_others_may_write_is_refused(
    short_tmp_path: Path,
) -> None:
    parent = short_tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)  # no sticky bit: anyone may rename what is in it
    work = parent / "work"
    code, err = run_no_checks(work)
    assert code == 2, err
    assert f"--work-dir {work} is inside {parent}, which others may write (mode 0777" in err
    assert list(work.iterdir()) == []


def test_a_symlink_as_work_dir_is_refused(short_tmp_path: Path) -> None:
    target = short_tmp_path / "target"
    target.mkdir(mode=0o700)
    link = short_tmp_path / "link"
    link.symlink_to(target)
    code, err = run_no_checks(link)
    assert code == 2, err
    assert f"--work-dir {link} is a symbolic link:" in err
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("exists", [False, True], ids=["absent", "empty"])
def test_an_absent_or_empty_work_dir_of_this_user_is_accepted(
    short_tmp_path: Path, exists: bool
) -> None:
    work = short_tmp_path / "deeper" / "work"
    if exists:
        work.mkdir(parents=True, mode=0o700)
    code, err = run_no_checks(work)
    assert (code, err) == (0, "")
    assert work.is_dir()
    assert stat.S_IMODE(work.stat().st_mode) & (stat.S_IWGRP | stat.S_IWOTH) == 0


def test_run_selftest_refuses_an_unsafe_work_dir_itself(short_tmp_path: Path) -> None:
    shared = short_tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(UnsafeDirectoryError, match="is writable by its group"):
        run_selftest(work_dir=shared, checks=())
    assert list(shared.iterdir()) == []
