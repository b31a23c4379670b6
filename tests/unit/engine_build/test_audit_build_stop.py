"""An audit of "engine builds are observable (phase trees), cooperatively cancellable
from every stop source, leave no partial artifacts and record their timing-cache
decisions", in one process (``run_build``, ``clean_up``, ``PhaseTree``):

* A fresh INT8 calibration cache was written by the builder as it returned, before
  the engine was staged, validated or committed: a build cancelled while its engine
  was validated, or whose engine failed validation, left a new calibration cache
  (and its sidecars) that the next build trusts.  It is now written in the commit's
  no-cancel zone, with the engine.
* A builder that crashed inside a phase left that phase ``running`` in the summary of
  the failed build (its ``activePath`` naming it).
* ``clean_up`` removed only the temp files of the engine and its sidecar: a killed
  build's half-written timing cache, summary or calibration cache stayed for ever.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from inferd.engine_build import BuildRequest, CancellationToken, run_build
from inferd.engine_build.artifacts import clean_up
from inferd.engine_build.calibration_batches import CalibrationBatches
from inferd.engine_build.events import BuildEvent, PhaseTree
from inferd.engine_build.progress import ProgressAdapter
from inferd.engine_build.simulated import BuilderOutput
from inferd.engines import calibration as calib
from inferd.engines.timing_cache import timing_cache_path
from inferd.types import BuildConfig
from tests.fakes import fake_tensorrt
from tests.unit.engine_build.conftest import HOST
from tests.unit.engine_build.test_tensorrt_builder import (
    INT8,
    calibrating_builder,
    calibration_set,
    scale_model,
)

__all__ = ["calibration_set"]  # the fixture: three calibration batches of ``scale_model``'s input


def _calibration_files(engines: Path) -> list[str]:
    return sorted(p.name for p in engines.glob("scale.calib_cache*"))


def _int8_build(
    gpu: fake_tensorrt.FakeGpuStack,
    tmp_path: Path,
    data: Path,
    infer: Any,
    token: CancellationToken | None = None,
) -> dict[str, Any]:
    model = scale_model(tmp_path / "scale.onnx")
    engine = tmp_path / "engines" / "scale.engine"
    builder = calibrating_builder(gpu, model, data, engine)
    builder.infer = infer
    return run_build(BuildRequest(model, engine, INT8, HOST), builder, token=token).summary


def test_a_build_cancelled_while_it_validates_keeps_no_fresh_calibration_cache(
    tmp_path: Path,
    calibration_set: Path,
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    token = CancellationToken()

    def cancelled_during_the_smoke_inference(_engine: Path, inputs: Any) -> Any:
        token.cancel("control", "the operator stops the build while it validates")
        return {"y": 2 * inputs["x"]}

    s = _int8_build(gpu, tmp_path, calibration_set, cancelled_during_the_smoke_inference, token)
    assert s["outcome"] == "cancelled" and s["builderStats"]["calibration"] == "calibrated"
    assert gpu.trt.calibration_batches == 3  # it did calibrate
    assert not (tmp_path / "engines" / "scale.engine").exists()
    assert _calibration_files(tmp_path / "engines") == [], "a cancelled build kept its cache"


def test_a_build_whose_engine_failed_validation_keeps_no_fresh_calibration_cache(
    tmp_path: Path,
    calibration_set: Path,
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    def wrong(_engine: Path, inputs: Any) -> Any:
        return {"y": 2 * inputs["x"] + 1.0}

    s = _int8_build(gpu, tmp_path, calibration_set, wrong)
    assert s["outcome"] == "completed" and s["validationStatus"] == "fail"
    assert s["validation"]["quarantinedTo"] is not None
    assert _calibration_files(tmp_path / "engines") == [], "a failed engine's cache was kept"


def test_a_validated_int8_build_keeps_its_calibration_cache_with_its_engine(
    tmp_path: Path,
    calibration_set: Path,
    gpu: fake_tensorrt.FakeGpuStack,
) -> None:
    """The control: the cache is still written when the engine is committed."""
    s = _int8_build(gpu, tmp_path, calibration_set, lambda _e, i: {"y": 2 * i["x"]})
    assert s["outcome"] == "completed" and s["validationStatus"] == "pass"
    engines = tmp_path / "engines"
    assert (engines / "scale.engine").is_file()
    assert _calibration_files(engines) == [
        "scale.calib_cache",
        "scale.calib_cache.dataset_sha256",
        "scale.calib_cache.sha256",
    ]
    cache = calib.calibration_cache_path(engines / "scale.engine")
    assert calib.dataset_sidecar_path(cache).read_text().strip() == calib.dataset_sha256(
        calibration_set
    )


class _CrashingBuilder:
    """Starts two nested phases, then raises (a TensorRT or driver error)."""

    simulated = True
    tensorrt_version = "simulated-crash"
    infer = None

    def refuses_cache(self, data: bytes) -> str | None:
        return None

    def build(self, monitor: ProgressAdapter, timing_cache: bytes | None) -> BuilderOutput:
        monitor.phase_start("Building engine", None, 2)
        monitor.phase_start("Tactic selection", "Building engine", 4)
        monitor.step_complete("Tactic selection", 0)
        raise RuntimeError("the builder crashed inside its tactic selection")


def test_a_cancel_during_calibration_stops_it_at_the_next_batch(
    tmp_path: Path,
    calibration_set: Path,
    gpu: fake_tensorrt.FakeGpuStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calibration runs inside ``build_serialized_network`` with no progress callback of
    its own: a cancel there waited for every batch (a large data set: minutes)."""
    token = CancellationToken()
    load = CalibrationBatches.load

    def cancelled_while_loading(self: CalibrationBatches, path: Path) -> Any:
        token.cancel("control", "the operator stops the build while it calibrates")
        return load(self, path)

    monkeypatch.setattr(CalibrationBatches, "load", cancelled_while_loading)
    s = _int8_build(gpu, tmp_path, calibration_set, lambda _e, i: {"y": 2 * i["x"]}, token)
    assert s["outcome"] == "cancelled" and s["cancelSource"] == "control"
    assert gpu.trt.calibration_batches == 1, "calibration went on after the cancel"
    assert s["cleanupStatus"] == "cleaned" and s["timingCacheMode"] == "discarded"
    assert _calibration_files(tmp_path / "engines") == []
    assert not (tmp_path / "engines" / "scale.engine").exists()


def test_a_builder_crash_leaves_no_phase_running_in_the_summary(
    tmp_path: Path, demo_model: Path
) -> None:
    engine = tmp_path / "engines" / "demo.engine"
    report = run_build(BuildRequest(demo_model, engine, BuildConfig(), HOST), _CrashingBuilder())
    s = report.summary
    assert s["outcome"] == "failed" and "crashed" in s["error"]
    tree = s["phaseTree"]
    assert tree["state"] == "failed"
    top = tree["roots"][0]
    statuses = [top["status"]] + [child["status"] for child in top["children"]]
    assert statuses == ["finished_early", "finished_early"], tree
    assert tree["activePath"] == [], "a phase of a failed build still running"
    assert top["durationMs"] is not None
    assert s["timingCacheMode"] == "discarded" and not s["timingCache"]["saved"]


def _event(type_: str, mono_ns: int, **fields: Any) -> BuildEvent:
    given: dict[str, Any] = {
        "phase_id": None,
        "parent_id": None,
        "name": None,
        "step": None,
        "num_steps": None,
        **fields,
    }
    return BuildEvent(
        "b", 0, type_, **given, mono_ns=mono_ns, wall_ns=0, thread="t", cancel_state="none"
    )


def test_a_terminal_event_ends_every_running_phase() -> None:
    tree = PhaseTree.from_events(
        [
            _event("phase_start", 100, phase_id="p1", name="Building engine", num_steps=2),
            _event("phase_start", 200, phase_id="p2", parent_id="p1", name="T", num_steps=3),
            _event("step", 300, phase_id="p2", name="T", step=2),
            _event("phase_finish", 400, phase_id="p2", name="T"),
            _event("cancelled", 1_000_100),
        ]
    )
    snap = tree.snapshot()
    assert snap["state"] == "cancelled" and snap["activePath"] == []
    top = snap["roots"][0]
    assert (top["status"], top["durationMs"]) == ("finished_early", 1.0)
    assert top["children"][0]["status"] == "finished"  # finished before: as it was


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.parametrize(
    "name",
    [
        "scale.engine.b1-abcdef.build.json",  # its summary or commit record
        "scale.calib_cache",
        "scale.calib_cache.sha256",
        "scale.calib_cache.dataset_sha256",
        timing_cache_path(Path("."), HOST).name,
    ],
)
def test_a_dead_builds_temp_files_are_removed_a_live_ones_left(tmp_path: Path, name: str) -> None:
    engines = tmp_path / "engines"
    engines.mkdir(mode=0o700)
    dead = engines / f".{name}.tmp-{_dead_pid()}-0123abcd"
    live = engines / f".{name}.tmp-1-0123abcd"  # pid 1: always alive, never ours
    other = engines / f".other.engine.tmp-{_dead_pid()}-0123abcd"  # another engine's
    for path in (dead, live, other):
        path.write_bytes(b"half written")
    report = clean_up(engines / "scale.engine")
    assert not dead.exists(), f"a killed build's {name} left"
    assert report.removed == [dead.name] and report.status == "cleaned"
    assert live.exists() and [item["path"] for item in report.left] == [live.name]
    assert other.exists()


def test_this_processs_own_temp_of_a_timing_cache_is_removed(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    engines.mkdir(mode=0o700)
    cache = engines / f".{timing_cache_path(engines, HOST).name}.tmp-{os.getpid()}-0a1b2c3d"
    cache.write_bytes(b"half written")
    assert clean_up(engines / "scale.engine").removed == [cache.name]
    assert not cache.exists()
