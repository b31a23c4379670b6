"""``inferd.digest.sha256_file`` and ``inferd.owned_files.open_regular_file``: a file in
the daemon's own directories is hashed without following a symlink (refused with
``open_nofollow``'s message), an operator's file (``follow=True``) through one; only a
regular file is hashed, checked on the descriptor that is read, and a FIFO is refused
without blocking (DESIGN.md entry 125)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from inferd.digest import sha256_file
from inferd.owned_files import open_for_reading, open_regular_file, unsafe_owned_dir_reason

SYMLINK_REFUSAL = "is a symbolic link, which inferd does not follow in its own directories"


def test_a_symlink_is_refused_unless_followed_by_choice(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"operator's bytes")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError, match=SYMLINK_REFUSAL) as caught:
        sha256_file(link)
    assert str(link) in str(caught.value)
    assert sha256_file(link, follow=True) == hashlib.sha256(b"operator's bytes").hexdigest()
    with open_for_reading(link, follow=True) as handle:
        assert handle.read() == b"operator's bytes"


@pytest.mark.parametrize("follow", [False, True])
def test_only_a_regular_file_is_read_and_a_fifo_does_not_block(
    tmp_path: Path, follow: bool
) -> None:
    fifo = tmp_path / "engine.fifo"
    os.mkfifo(fifo)  # opening it for reading without O_NONBLOCK would wait for a writer
    with pytest.raises(OSError, match="is not a regular file"):
        sha256_file(fifo, follow=follow)
    with pytest.raises(OSError, match="is not a regular file"):
        sha256_file(tmp_path, follow=follow)


def test_the_stat_is_the_open_files(tmp_path: Path) -> None:
    path = tmp_path / "engine"
    path.write_bytes(b"12345")
    handle, info = open_regular_file(path)
    with handle:
        path.rename(tmp_path / "moved")
        path.write_bytes(b"another file")  # the name now names another file
        assert handle.read() == b"12345" and info.st_size == 5
        assert info.st_ino == os.fstat(handle.fileno()).st_ino != path.stat().st_ino


def test_the_directory_rule_as_a_reason(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir(mode=0o750)
    assert unsafe_owned_dir_reason(own) is None
    os.chmod(own, 0o777)
    assert unsafe_owned_dir_reason(own) == "is writable by its group and others (mode 0777)"
    assert unsafe_owned_dir_reason(tmp_path / "absent") == "does not exist"
