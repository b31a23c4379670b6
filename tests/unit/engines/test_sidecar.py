"""Digest sidecars (``inferd.engines.sidecar``): sha256sum-compatible, strict
parsing, bounded reads and memory, atomic replacement."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from inferd.digest import sha256_file
from inferd.engines import EngineGate, Manifest, read_sidecar, sidecar_path, write_sidecar
from inferd.errors import EngineHashMismatchError, EngineSidecarMissingError
from tests.unit.engines.conftest import CONTENT, HOST, VALID


def test_sidecar_is_sha256sum_compatible(tmp_path: Path) -> None:
    engine = tmp_path / VALID
    engine.write_bytes(CONTENT)
    path = write_sidecar(engine)
    assert path == sidecar_path(engine) == tmp_path / (VALID + ".sha256")
    digest = hashlib.sha256(CONTENT).hexdigest()
    assert path.read_text() == f"{digest}  {VALID}\n"
    assert read_sidecar(engine) == digest
    if shutil.which("sha256sum"):
        checked = subprocess.run(
            ["sha256sum", "-c", path.name], cwd=tmp_path, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "found 0 non-empty line"),
        ("abc  x\n", "is not '<64 hex digits>  <file name>'"),
        ("{d}  {n}\n{d}  {n}\n", "found 2 non-empty line"),
        ("{d}  other.engine\n", "is for 'other.engine'"),
        ("{d}x  {n}\n", "is not '<64 hex digits>"),
    ],
)
def test_malformed_sidecars_are_hash_refusals(tmp_path: Path, text: str, fragment: str) -> None:
    engine = tmp_path / VALID
    engine.write_bytes(CONTENT)
    digest = hashlib.sha256(CONTENT).hexdigest()
    sidecar_path(engine).write_text(text.format(d=digest, n=VALID))
    with pytest.raises(EngineHashMismatchError, match=fragment) as caught:
        read_sidecar(engine)
    assert caught.value.stage == "sidecar"


def test_sidecar_variants_that_are_accepted(tmp_path: Path) -> None:
    engine = tmp_path / VALID
    digest = hashlib.sha256(CONTENT).hexdigest()
    for text in (f"{digest}\n", f"{digest.upper()} *{VALID}\n", f"\n{digest}  {VALID}\n\n"):
        sidecar_path(engine).write_text(text)
        assert read_sidecar(engine) == digest


def test_oversized_or_binary_sidecars_are_not_read_whole(tmp_path: Path) -> None:
    engine = tmp_path / VALID
    sidecar_path(engine).write_bytes(b"0" * 10_000_000)
    with pytest.raises(EngineHashMismatchError, match="larger than 4096 bytes"):
        read_sidecar(engine)
    sidecar_path(engine).write_bytes(b"\xff\xfe")
    with pytest.raises(EngineHashMismatchError, match="not ASCII"):
        read_sidecar(engine)
    sidecar_path(engine).unlink()
    with pytest.raises(EngineSidecarMissingError, match="has no digest sidecar"):
        read_sidecar(engine)


def _peak_bytes(action: Any) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _sparse(path: Path, size: int) -> Path:
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


def test_large_engines_are_hashed_with_bounded_memory(tmp_path: Path) -> None:
    size = 64 * 1024 * 1024
    engine = _sparse(tmp_path / VALID, size)
    expected = hashlib.sha256(bytes(size)).hexdigest()
    # The measurement sees a whole-file read (so the bound below can fail) ...
    assert _peak_bytes(engine.read_bytes) > size
    # ... and the digest, the sidecar writer and the whole gate stay near one chunk.
    assert _peak_bytes(lambda: sha256_file(engine)) < 4 * 1024 * 1024
    assert _peak_bytes(lambda: write_sidecar(engine)) < 4 * 1024 * 1024
    assert read_sidecar(engine) == expected
    gate = EngineGate(HOST, Manifest({VALID: expected}), record=None)
    assert _peak_bytes(lambda: gate.validate(engine)) < 4 * 1024 * 1024


def test_write_sidecar_replaces_atomically(tmp_path: Path) -> None:
    engine = tmp_path / VALID
    engine.write_bytes(CONTENT)
    write_sidecar(engine, "0" * 64)
    write_sidecar(engine)
    assert read_sidecar(engine) == hashlib.sha256(CONTENT).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == [VALID, VALID + ".sha256"]
    assert sidecar_path(engine).stat().st_mode & 0o777 == 0o640  # never world-readable


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_sidecar_write_leaves_the_old_one_and_no_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    engine = tmp_path / VALID
    engine.write_bytes(CONTENT)
    write_sidecar(engine, "a" * 64)
    before = sidecar_path(engine).read_bytes()

    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    with pytest.raises(OSError, match="No space left"):
        write_sidecar(engine)
    monkeypatch.undo()
    assert sidecar_path(engine).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [VALID, VALID + ".sha256"]
