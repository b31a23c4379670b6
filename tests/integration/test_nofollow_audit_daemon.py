"""A real daemon against a ``staging`` symlink in its engine dir (the audit of DESIGN.md
entries 54 and 125): at its start the daemon sweeps dead builds' staging folders in
``runtime.engine_dir``; it used to do so through a link another user planted in an
engine dir of theirs, creating ``.lock`` and removing every file in each digit-named
folder of the link's target as the daemon's user (root here, as a daemon run outside
systemd is)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory, OtherUser, wait_until

pytestmark = pytest.mark.integration


def test_a_staging_link_in_another_user_s_engine_dir_is_not_swept_at_start(
    tmp_path: Path, daemon_factory: DaemonFactory, other_user: OtherUser
) -> None:
    victim = tmp_path / "victim"  # root's, with a folder per uid as /run/user has
    (victim / "4242").mkdir(parents=True)
    (victim / "4242" / "bus").write_text("root's file\n")
    engine_dir = tmp_path / "engines"
    engine_dir.mkdir(mode=0o755)
    (engine_dir / "staging").symlink_to(victim)  # what the other user planted
    os.lchown(engine_dir / "staging", other_user.uid, other_user.gid)
    os.chown(engine_dir, other_user.uid, other_user.gid)

    daemon = daemon_factory(runtime={"engine_dir": str(engine_dir)})
    wait_until(lambda: "build_staging_swept" in daemon.log(), 10, message="the start's sweep")
    (line,) = [line for line in daemon.log().splitlines() if "build_staging_swept" in line]
    assert str(engine_dir / "staging") in line and "is a symbolic link" in line
    assert sorted(p.name for p in (victim / "4242").iterdir()) == ["bus"]
    assert (victim / "4242" / "bus").read_text() == "root's file\n"
    assert daemon.stop() == 0
