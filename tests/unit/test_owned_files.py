"""``inferd.owned_files`` and the directory rule it shares with the clients
(``inferd_wire.endpoints.unsafe_directory_reason``): a directory the daemon creates
files or sockets in is its own and only it may write; files there are opened without
following symlinks; the umask is the systemd unit's."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from inferd.errors import UnsafeDirectoryError
from inferd.owned_files import (
    OWNED_UMASK,
    apply_owned_umask,
    ensure_owned_dir,
    open_for_reading,
    open_nofollow,
)
from inferd_wire.endpoints import unsafe_directory_reason


def test_a_missing_directory_is_created_private(tmp_path: Path) -> None:
    made = ensure_owned_dir(tmp_path / "a" / "b", what="daemon.state_dir")
    assert made.is_dir()
    assert stat.S_IMODE(made.stat().st_mode) & 0o027 == 0


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_directory_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(UnsafeDirectoryError, match=r"daemon.runtime_dir .* is writable by"):
        ensure_owned_dir(shared, what="daemon.runtime_dir")


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeDirectoryError, match="is a symbolic link"):
        ensure_owned_dir(link, what="fdr.directory")


def test_another_owner_is_refused(tmp_path: Path) -> None:
    assert unsafe_directory_reason(tmp_path, os.geteuid() + 1) == (
        f"is owned by uid {os.geteuid()}, not by uid {os.geteuid() + 1}"
    )
    assert unsafe_directory_reason(tmp_path, os.geteuid()) is None
    assert unsafe_directory_reason(tmp_path / "nope", None) == "does not exist"
    (tmp_path / "file").write_text("x")
    assert unsafe_directory_reason(tmp_path / "file", None) == "is not a directory"


def test_files_are_opened_without_following_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    planted = tmp_path / "inferd.lock"
    planted.symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link, which inferd does not follow"):
        open_nofollow(planted, os.O_RDWR | os.O_CREAT)
    with pytest.raises(OSError, match="symbolic link"):
        open_for_reading(planted)
    assert victim.read_text() == "keep me\n"
    fd = open_nofollow(tmp_path / "fresh", os.O_WRONLY | os.O_CREAT)
    try:
        assert os.get_inheritable(fd) is False  # O_CLOEXEC
    finally:
        os.close(fd)


def test_the_umask_is_the_units(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        apply_owned_umask()
        assert os.umask(OWNED_UMASK) == 0o027
        fd = os.open(tmp_path / "new", os.O_WRONLY | os.O_CREAT, 0o666)
        os.close(fd)
        assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o640
    finally:
        os.umask(previous)
