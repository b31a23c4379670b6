"""Calibration-cache trust (``inferd.engines.calibration``): dataset hash, integrity
sidecar, crash while storing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inferd.engines import calibration as calib
from inferd.errors import (
    CalibrationCacheError,
)


def test_dataset_hash_covers_names_and_content(dataset: Path) -> None:
    digest = calib.dataset_sha256(dataset)
    assert digest == calib.dataset_sha256(dataset)
    (dataset / "batch0.npz").rename(dataset / "batch9.npz")
    renamed = calib.dataset_sha256(dataset)
    assert renamed != digest
    with (dataset / "batch1.npz").open("ab") as handle:
        handle.write(b"\0")
    assert calib.dataset_sha256(dataset) not in (digest, renamed)
    with pytest.raises(CalibrationCacheError, match="does not exist"):
        calib.dataset_sha256(dataset / "absent")


def store_at(tmp_path: Path, digest: str = "a" * 64) -> calib.CalibrationCacheStore:
    return calib.CalibrationCacheStore(tmp_path / "m.calib_cache", digest)


def test_calibration_cache_is_reused_only_for_its_dataset(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    assert store.load().status == "absent"
    store.store(b"TRT-100300-EntropyCalibration2\nx: 3c010a14\n")
    assert (tmp_path / "m.calib_cache.sha256").read_text().endswith("  m.calib_cache\n")
    assert (tmp_path / "m.calib_cache.dataset_sha256").read_text() == "a" * 64 + "\n"
    lookup = store.load()
    assert lookup.status == "reused" and lookup.data is not None
    changed = store_at(tmp_path, "b" * 64).load()
    assert changed.status == "dataset_changed" and changed.data is None


@pytest.mark.parametrize("sidecar", [".sha256", ".dataset_sha256"])
def test_a_missing_sidecar_means_recalibrate(tmp_path: Path, sidecar: str) -> None:
    store = store_at(tmp_path)
    store.store(b"cache")
    (tmp_path / f"m.calib_cache{sidecar}").unlink()
    lookup = store.load()
    assert lookup.status == "untrusted" and lookup.data is None


@pytest.mark.parametrize(
    ("sidecar", "text"),
    [
        (".sha256", "not a digest\n"),
        (".sha256", f"{'0' * 64}  other.calib_cache\n"),
        (".sha256", f"{'0' * 64}  m.calib_cache\n{'1' * 64}  m.calib_cache\n"),
        (".dataset_sha256", "zz\n"),
        (".dataset_sha256", "\xff\xfe"),
    ],
)
def test_a_corrupt_sidecar_is_an_error_and_never_overwritten(
    tmp_path: Path, sidecar: str, text: str
) -> None:
    store = store_at(tmp_path)
    store.store(b"cache")
    path = tmp_path / f"m.calib_cache{sidecar}"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(CalibrationCacheError, match="corrupt"):
        store.load()
    with pytest.raises(CalibrationCacheError, match="corrupt"):
        store.store(b"new cache")
    assert path.read_bytes() == text.encode("latin-1")
    assert (tmp_path / "m.calib_cache").read_bytes() == b"cache"


def test_a_cache_that_does_not_match_its_integrity_sidecar_is_an_error(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.store(b"cache")
    (tmp_path / "m.calib_cache").write_bytes(b"cachf")
    with pytest.raises(CalibrationCacheError, match="does not match its integrity sidecar"):
        store.load()
    assert (tmp_path / "m.calib_cache").read_bytes() == b"cachf"


def test_a_crash_while_storing_reads_as_untrusted_not_as_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_at(tmp_path)
    store.store(b"old cache")
    real = calib.atomic_write_text

    def crash_on_sidecars(path: Path, text: str, **kwargs: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(calib, "atomic_write_text", crash_on_sidecars)
    with pytest.raises(CalibrationCacheError, match="cannot write"):
        store_at(tmp_path, "b" * 64).store(b"new cache")
    monkeypatch.setattr(calib, "atomic_write_text", real)
    for digest in ("a" * 64, "b" * 64):
        assert store_at(tmp_path, digest).load().status == "untrusted"
