"""``inferd.owned_files`` and the directory rule it shares with the clients
(``inferd_wire.endpoints.unsafe_directory_reason``): a directory the daemon creates
files or sockets in is its own and only it may write; files there are opened without
following symlinks; the umask is the systemd unit's."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from inferd.errors import UncheckedDirectoryError, UnsafeDirectoryError
from inferd.owned_files import (
    OWNED_UMASK,
    apply_owned_umask,
    ensure_owned_dir,
    open_for_reading,
    open_nofollow,
)
from inferd_wire.endpoints import unsafe_directory_reason
from tests.conftest import TAKE_EVERY_DESCRIPTOR


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


def test_a_path_through_a_file_is_unsafe_not_unchecked(tmp_path: Path) -> None:
    """A file where a directory is to be made is the directory's fault (exit 2)."""
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(UnsafeDirectoryError, match="cannot be created") as raised:
        ensure_owned_dir(tmp_path / "file" / "sub", what="daemon.state_dir")
    assert not isinstance(raised.value, UncheckedDirectoryError)


#: Run at the descriptor limit: every free descriptor taken, then the directory
#: made or checked.  Prints what was raised, its class and errno.
_AT_THE_LIMIT = (
    """
import sys
from pathlib import Path
from inferd.owned_files import ensure_owned_dir
"""
    + TAKE_EVERY_DESCRIPTOR
    + """
try:
    ensure_owned_dir(Path(sys.argv[1]), what="daemon.runtime_dir")
except Exception as exc:
    print(type(exc).__name__, getattr(exc, "errno", None), exc, sep="|")
else:
    print("made")
"""
)


@pytest.mark.parametrize("exists", [True, False])
def test_a_directory_met_at_the_descriptor_limit_is_unchecked_not_unsafe(
    tmp_path: Path, exists: bool
) -> None:
    """``EMFILE`` is this process's state, not the directory's: the error says so and
    names the errno (``inferd run`` then exits 1 and is restarted), where it used to
    say the directory "cannot be opened" or "cannot be created" and to fix its owner."""
    directory = tmp_path / "run"
    if exists:
        directory.mkdir(mode=0o750)
    done = subprocess.run(
        [sys.executable, "-c", _AT_THE_LIMIT, str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    kind, code, message = done.stdout.strip().split("|")
    assert (kind, int(code)) == ("UncheckedDirectoryError", errno.EMFILE)
    verb = "checked" if exists else "created"
    assert message.startswith(f"daemon.runtime_dir {directory} could not be {verb} (EMFILE: ")
    assert "owner" not in message
