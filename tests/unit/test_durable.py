"""``inferd.durable``: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.durable import atomic_output, atomic_write_bytes


def test_atomic_output_replaces_the_file_only_when_the_writer_finishes(tmp_path: Path) -> None:
    target = tmp_path / "flight.mcap"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError), atomic_output(target) as handle:
        handle.write(b"half of the new")
        assert target.read_bytes() == b"old"  # nothing visible while it is written
        raise RuntimeError("the export failed")
    assert target.read_bytes() == b"old"
    assert [path.name for path in tmp_path.iterdir()] == ["flight.mcap"]  # temp removed
    with atomic_output(target, mode=0o600) as handle:
        handle.write(b"new, ")
        handle.write(b"in pieces")
    assert target.read_bytes() == b"new, in pieces"
    assert target.stat().st_mode & 0o777 == 0o600
    assert [path.name for path in tmp_path.iterdir()] == ["flight.mcap"]
