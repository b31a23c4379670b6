"""The deployment manifest (``inferd.engines.manifest``): lookups by name and
path, conflicting and malformed manifests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from inferd.engines import Manifest, write_manifest
from inferd.errors import EngineHashMismatchError, EngineManifestError


def test_manifest_lookup_by_name_relative_and_absolute_path(tmp_path: Path) -> None:
    (tmp_path / "engines").mkdir()
    digests = {key: hashlib.sha256(key.encode()).hexdigest() for key in "abc"}
    manifest_path = tmp_path / "manifest.json"
    write_manifest(
        manifest_path,
        {
            "a.engine": digests["a"],
            "engines/b.engine": digests["b"],
            str(tmp_path / "elsewhere" / "c.engine"): digests["c"].upper(),
        },
    )
    manifest = Manifest.load(manifest_path)
    assert len(manifest) == 3
    assert manifest.lookup(tmp_path / "anywhere" / "a.engine") == digests["a"]
    assert manifest.lookup(tmp_path / "engines" / "b.engine") == digests["b"]
    assert manifest.lookup(tmp_path / "engines" / ".." / "engines" / "b.engine") == digests["b"]
    assert manifest.lookup(tmp_path / "elsewhere" / "c.engine") == digests["c"]
    assert manifest.get(tmp_path / "b.engine") is None  # a path entry matches that path only
    assert json.loads(manifest_path.read_text())["version"] == 1


def test_a_missing_manifest_entry_is_a_hash_refusal_not_a_key_error(tmp_path: Path) -> None:
    manifest = Manifest({"a.engine": "0" * 64}, source="m.json")
    with pytest.raises(EngineHashMismatchError) as caught:
        manifest.lookup(tmp_path / "b.engine")
    assert not isinstance(caught.value, KeyError)
    assert caught.value.stage == "manifest"
    assert "'b.engine' is not listed in the deployment manifest m.json" in str(caught.value)


def test_conflicting_entries_for_one_engine_are_refused(tmp_path: Path) -> None:
    manifest = Manifest(
        {"a.engine": "0" * 64, str(tmp_path / "a.engine"): "1" * 64}, source="m.json"
    )
    with pytest.raises(EngineHashMismatchError, match="twice with different digests"):
        manifest.lookup(tmp_path / "a.engine")
    with pytest.raises(EngineManifestError, match="same file with different digests"):
        Manifest({"/x/a.engine": "0" * 64, "/x/../x/a.engine": "1" * 64})


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "is not valid JSON"),
        ("[]", "the top level must be an object"),
        ('{"version": 2, "engines": {}}', "has version 2"),
        ('{"version": true, "engines": {}}', "has version True"),
        ('{"version": 1.0, "engines": {}}', "has version 1.0"),
        ('{"engines": {}}', "has version None"),
        ('{"version": 1, "engines": []}', "'engines' must be an object"),
        ('{"version": 1, "engines": {}, "extra": 1}', "unknown key(s) ['extra']"),
        ('{"version": 1, "engines": {"a.engine": "abc"}}', "must be 64 hex digits"),
        ('{"version": 1, "engines": {"a.engine": 7}}', "must be 64 hex digits"),
        ('{"version": 1, "engines": {"": "' + "0" * 64 + '"}}', "non-empty path or file name"),
        (
            '{"version": 1, "engines": {"a.engine": "' + "0" * 64 + '", "a.engine": "'
            "" + "1" * 64 + '"}}',
            "duplicate key 'a.engine'",
        ),
    ],
)
def test_malformed_manifests_raise_a_clear_error(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "manifest.json"
    path.write_text(text)
    with pytest.raises(EngineManifestError) as caught:
        Manifest.load(path)
    assert fragment in str(caught.value)
    assert str(path) in str(caught.value)


def test_unreadable_manifest(tmp_path: Path) -> None:
    with pytest.raises(EngineManifestError, match="cannot be read"):
        Manifest.load(tmp_path / "absent.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(EngineManifestError, match="not UTF-8"):
        Manifest.load(tmp_path / "bin.json")
