"""What a build reads in the daemon's own engine dir is never read through a symlink
(DESIGN.md entry 125): the timing cache, an engine left at the final path, the
inventory, the sidecar gate, the simulated smoke inference and the trust record."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from inferd.engine_build.artifacts import (
    TimingCacheManager,
    TimingCacheOutcome,
    clean_up,
    inventory,
)
from inferd.engine_build.pipeline import record_trust
from inferd.engine_build.simulated import SimulatedBuilder
from inferd.engine_build.validation import sidecar_gate
from inferd.engines.sidecar import write_sidecar
from inferd.types import HostTuple, PrecisionMode

HOST = HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP32)
SYMLINK_REFUSAL = "is a symbolic link, which inferd does not follow in its own directories"


@pytest.fixture
def engine_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "engines"
    directory.mkdir(mode=0o750)
    return directory


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_timing_cache_is_quarantined_not_read(
    engine_dir: Path, tmp_path: Path, dangling: bool
) -> None:
    """A dangling link used to pass as "no cache" (``exists()`` follows) and be
    replaced silently; a link to a file was stat-ed through.  Both are moved aside
    as the link itself, naming it."""
    target = tmp_path / "elsewhere.cache"
    if not dangling:
        target.write_bytes(b"someone else's cache")
    manager = TimingCacheManager(engine_dir, HOST)
    manager.path.symlink_to(target)
    assert manager.load() is None
    assert manager.decision is TimingCacheOutcome.QUARANTINED
    assert manager.reason is not None and SYMLINK_REFUSAL in manager.reason
    assert manager.quarantined_to is not None and Path(manager.quarantined_to).is_symlink()
    assert not os.path.lexists(manager.path)
    if not dangling:
        assert target.read_bytes() == b"someone else's cache"


def _engine_elsewhere(engine_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``<engine_dir>/m.engine`` a symlink to a file with a matching regular sidecar."""
    target = tmp_path / "elsewhere.engine"
    target.write_bytes(b"engine bytes")
    engine = engine_dir / "m.engine"
    engine.symlink_to(target)
    write_sidecar(engine, hashlib.sha256(b"engine bytes").hexdigest())
    return engine, target


def test_clean_up_quarantines_a_symlink_at_the_final_path(engine_dir: Path, tmp_path: Path) -> None:
    """It used to be kept: its target's digest matched the sidecar."""
    engine, target = _engine_elsewhere(engine_dir, tmp_path)
    report = clean_up(engine)
    assert report.status == "quarantined"
    (moved,) = report.quarantined
    assert moved["reason"].startswith("engine cannot be read: ")
    assert SYMLINK_REFUSAL in moved["reason"]
    assert Path(moved["path"]).is_symlink() and target.read_bytes() == b"engine bytes"


def test_the_sidecar_gate_and_the_trust_record_refuse_a_symlinked_engine(
    engine_dir: Path, tmp_path: Path
) -> None:
    engine, _ = _engine_elsewhere(engine_dir, tmp_path)
    with pytest.raises(OSError, match=SYMLINK_REFUSAL):
        sidecar_gate(engine)
    summary = {
        "outcome": "completed",
        "validationStatus": "pass",
        "baseline": {"engineSha256": hashlib.sha256(b"engine bytes").hexdigest()},
    }
    decision = record_trust(summary, engine, manifest=engine_dir / "manifest.json")
    assert not decision.trusted and SYMLINK_REFUSAL in decision.note
    assert not (engine_dir / "manifest.json").exists()


def test_the_inventory_lists_regular_files_only(engine_dir: Path, tmp_path: Path) -> None:
    engine, _ = _engine_elsewhere(engine_dir, tmp_path)
    sidecar = engine_dir / "m.engine.sha256"
    assert inventory(engine_dir) == [{"path": sidecar.name, "bytes": sidecar.stat().st_size}]
    assert os.path.islink(engine)


def test_the_simulated_smoke_inference_does_not_read_through_a_symlink(
    engine_dir: Path, tmp_path: Path
) -> None:
    engine, _ = _engine_elsewhere(engine_dir, tmp_path)
    with pytest.raises(OSError, match=SYMLINK_REFUSAL):
        SimulatedBuilder.simulated_infer(engine, {"x": np.zeros((1, 1), np.float32)})
