"""``inferd.digest.sha256_remembered`` / ``remembered_sha256``: a model's digest taken
at load answers later questions without reading the file, and only while the file
the path names is the very version hashed (DESIGN.md entry 130)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from inferd import digest
from inferd.digest import remembered_sha256, sha256_remembered


def test_a_remembered_digest_is_given_only_for_the_version_hashed(tmp_path: Path) -> None:
    model = tmp_path / "model.onnx"
    model.write_bytes(b"version 1")
    assert remembered_sha256(model) is None  # never hashed
    assert sha256_remembered(model) == hashlib.sha256(b"version 1").hexdigest()
    assert remembered_sha256(model) == hashlib.sha256(b"version 1").hexdigest()
    before = model.stat()
    model.write_bytes(b"version 2")  # same size, and the mtime put back
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert remembered_sha256(model) is None
    model.unlink()
    assert remembered_sha256(model) is None


def test_a_symlink_retargeted_since_is_not_the_file_hashed(tmp_path: Path) -> None:
    first, second = tmp_path / "a.onnx", tmp_path / "b.onnx"
    first.write_bytes(b"same bytes")
    second.write_bytes(b"same bytes")
    link = tmp_path / "model.onnx"
    link.symlink_to(first)
    sha256_remembered(link)
    assert remembered_sha256(link) is not None
    link.unlink()
    link.symlink_to(second)
    assert remembered_sha256(link) is None


def test_what_is_remembered_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "_REMEMBERED_MAX", 3)
    monkeypatch.setattr(digest, "_remembered", type(digest._remembered)())
    paths = []
    for i in range(5):
        path = tmp_path / f"m{i}.onnx"
        path.write_bytes(bytes([i]))
        sha256_remembered(path)
        paths.append(path)
    assert [remembered_sha256(p) is not None for p in paths] == [False, False, True, True, True]
