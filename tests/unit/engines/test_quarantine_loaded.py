"""``inferd.engines.quarantine.quarantine_loaded``: a failover moves aside the engine
file it loaded, known by its device, inode and SHA-256, and nothing else its path
names by then; a file swapped in at the path at the moment of the move is put back,
never lost (DESIGN.md, "A failover quarantines the engine it loaded")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.digest import sha256_file
from inferd.engines.quarantine import QUARANTINE_DIR, NotTheLoadedEngineError, quarantine_loaded
from inferd.engines.sidecar import read_sidecar, write_sidecar
from inferd.types import EngineFile


def loaded_engine(directory: Path, content: bytes = b"the engine that failed") -> EngineFile:
    engine = directory / "demo.engine"
    engine.write_bytes(content)
    write_sidecar(engine)
    info = engine.stat()
    return EngineFile(info.st_dev, info.st_ino, sha256_file(engine))


def install(engine: Path, content: bytes) -> None:
    """What a build or an operator does: written aside, renamed over the path."""
    staged = engine.with_name(engine.name + ".staged")
    staged.write_bytes(content)
    staged.replace(engine)
    write_sidecar(engine)


def quarantined(directory: Path) -> list[str]:
    return sorted(path.name for path in (directory / QUARANTINE_DIR).iterdir())


def test_the_loaded_engine_is_moved_with_its_sidecar_and_why(tmp_path: Path) -> None:
    loaded = loaded_engine(tmp_path)
    moved = quarantine_loaded(tmp_path / "demo.engine", loaded, "failed while serving")
    assert moved.read_bytes() == b"the engine that failed"
    assert quarantined(tmp_path) == [moved.name, f"{moved.name}.reason", f"{moved.name}.sha256"]
    assert Path(f"{moved}.reason").read_text() == "failed while serving\n"
    assert not (tmp_path / "demo.engine").exists()
    assert not (tmp_path / "demo.engine.sha256").exists()


def test_a_sidecar_that_holds_another_digest_stays(tmp_path: Path) -> None:
    loaded = loaded_engine(tmp_path)
    write_sidecar(tmp_path / "demo.engine", "1" * 64)  # not this engine's
    moved = quarantine_loaded(tmp_path / "demo.engine", loaded, "failed while serving")
    assert quarantined(tmp_path) == [moved.name, f"{moved.name}.reason"]
    assert read_sidecar(tmp_path / "demo.engine") == "1" * 64


@pytest.mark.parametrize(
    ("since", "says"),
    [("installed", "is another file now"), ("rewritten", "holds other bytes now")],
)
def test_another_file_at_the_path_is_left_where_it_is(
    tmp_path: Path, since: str, says: str
) -> None:
    loaded = loaded_engine(tmp_path)
    engine = tmp_path / "demo.engine"
    if since == "installed":
        install(engine, b"a newer engine")
    else:  # the same inode, other bytes
        engine.write_bytes(b"a newer engine")
        write_sidecar(engine)
    with pytest.raises(NotTheLoadedEngineError, match=says):
        quarantine_loaded(engine, loaded, "failed while serving")
    assert engine.read_bytes() == b"a newer engine"
    assert read_sidecar(engine) == sha256_file(engine)
    assert not (tmp_path / QUARANTINE_DIR).exists()


def test_an_engine_removed_since_it_was_loaded_is_said_so(tmp_path: Path) -> None:
    loaded = loaded_engine(tmp_path)
    (tmp_path / "demo.engine").unlink()
    with pytest.raises(NotTheLoadedEngineError, match=r"nothing is at .* now"):
        quarantine_loaded(tmp_path / "demo.engine", loaded, "failed while serving")
    assert not (tmp_path / QUARANTINE_DIR).exists()


def test_a_symlink_at_the_path_is_not_followed(tmp_path: Path) -> None:
    loaded = loaded_engine(tmp_path)
    engine = tmp_path / "demo.engine"
    kept = engine.rename(tmp_path / "kept.engine")
    engine.symlink_to(kept.name)  # names the very file that was loaded
    with pytest.raises(OSError, match="symbolic link"):
        quarantine_loaded(engine, loaded, "failed while serving")
    assert engine.is_symlink() and kept.read_bytes() == b"the engine that failed"


def test_a_file_swapped_in_as_the_engine_is_moved_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The narrowest window: a newer engine renamed over the path after the last look
    at it and before the ``rename`` into quarantine: moved, seen, and put back."""
    loaded = loaded_engine(tmp_path)
    engine = tmp_path / "demo.engine"
    rename = os.rename

    def swapped_first(source: Any, target: Any) -> None:
        if Path(source) == engine:
            install(engine, b"a newer engine")
        rename(source, target)

    monkeypatch.setattr(os, "rename", swapped_first)
    with pytest.raises(NotTheLoadedEngineError, match="moved back"):
        quarantine_loaded(engine, loaded, "failed while serving")
    monkeypatch.undo()
    assert engine.read_bytes() == b"a newer engine"
    assert read_sidecar(engine) == sha256_file(engine)
    assert quarantined(tmp_path) == []  # its reserved name was given up too


def test_a_file_that_cannot_go_back_is_kept_in_the_quarantine_and_said_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapped in at the move, then yet another file at the path before it could go
    back: never put back over that one, kept in the quarantine, logged."""
    loaded = loaded_engine(tmp_path)
    engine = tmp_path / "demo.engine"
    rename, link = os.rename, os.link

    def swapped_first(source: Any, target: Any) -> None:
        if Path(source) == engine:
            install(engine, b"a newer engine")
        rename(source, target)

    def taken_first(source: Any, target: Any, **kwargs: Any) -> None:
        if Path(target) == engine:
            install(engine, b"the newest engine")
        link(source, target, **kwargs)

    monkeypatch.setattr(os, "rename", swapped_first)
    monkeypatch.setattr(os, "link", taken_first)
    with capture_logs() as logs, pytest.raises(NotTheLoadedEngineError, match="by hand") as raised:
        quarantine_loaded(engine, loaded, "failed while serving")
    monkeypatch.undo()
    assert engine.read_bytes() == b"the newest engine"
    (kept,) = quarantined(tmp_path)
    assert (tmp_path / QUARANTINE_DIR / kept).read_bytes() == b"a newer engine"
    assert kept in str(raised.value)
    (logged,) = [line for line in logs if line["event"] == "quarantine_moved_another_file"]
    assert logged["kept_at"] == str(tmp_path / QUARANTINE_DIR / kept)
