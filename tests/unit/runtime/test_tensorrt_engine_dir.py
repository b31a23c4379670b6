"""The ``tensorrt`` runtime trusts nothing in an engine dir that is not safely the
daemon's own, and never follows a symlink there (DESIGN.md entry 125), on the fake
TensorRT 10.3 and pycuda of ``tests/fakes``.

A review served an engine from an engine dir owned by ``nobody`` with mode 0777
(engine, sidecar and ``manifest.json`` in it): ``runtime=tensorrt, fallback=False``.
Now such a model serves on ``onnx_trt_ep``, as when no trusted engine exists, with the
reason in the failover record; once the dir is the daemon's own again it serves on
``tensorrt``.  The cause is ``UnsafeDirectoryError``, which no build fixes (a build
refuses that dir too), so none is asked for (review R1, F3: it was
``EngineMissingError``, and a build was asked for and refused at once)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from inferd.config import ModelConfig
from inferd.errors import EngineHashMismatchError, EngineMissingError, UnsafeDirectoryError
from inferd.serving.rebuild import FallbackRebuilder
from inferd.serving.slot import BUILD_FIXES, ModelSlot, Sinks
from inferd.types import Alert, BuildConfig, ThermalState
from tests.tensorrt_bench import Bench

NOBODY = 65534
SYMLINK_REFUSAL = "is a symbolic link, which inferd does not follow in its own directories"


def _spoil(directory: Path, how: str) -> str:
    if how == "mode 0777":
        os.chmod(directory, 0o777)
        return "is writable by its group and others (mode 0777)"
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    os.chown(directory, NOBODY, NOBODY)
    os.chmod(directory, 0o777)  # as the review's: anyone may swap engine and manifest
    return f"is owned by uid {NOBODY}, not by uid {os.geteuid()}"


@pytest.mark.parametrize("how", ["mode 0777", "owner nobody"])
def test_an_engine_dir_not_the_daemons_own_is_not_trusted_at_load(
    bench: Bench, demo_model: Path, how: str
) -> None:
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)  # engine + sidecar + manifest.json
    reason = _spoil(bench.engine_dir, how)
    calls_before = len(bench.gpu.trt.calls)
    with capture_logs() as logs, pytest.raises(UnsafeDirectoryError) as caught:
        runtime.compile_engine(demo_model, BuildConfig())
    message = str(caught.value)
    assert message.startswith(
        f"no trusted engine for this host: the engine dir {bench.engine_dir} {reason}: "
        "inferd trusts no engine and no manifest.json"
    )
    assert [log["reason"] for log in logs if log["event"] == "engine_dir_untrusted"] == [reason]
    # An entry located earlier (or a build's) is not loaded from there either.
    with pytest.raises(UnsafeDirectoryError) as refused:
        runtime.deserialize_engine(entry)
    assert f"not loaded: the engine dir {bench.engine_dir} {reason}: " in str(refused.value)
    assert "Runtime" not in bench.gpu.trt.calls[calls_before:]
    assert runtime.resident_count == 0
    assert entry.artifact_path.is_file() and not (bench.engine_dir / "quarantine").exists()


def _sinks(bench: Bench, events: list[tuple[str, Any]]) -> Sinks:
    return Sinks(
        alert=lambda _alert: None,
        events=lambda topic, payload: events.append((topic, dict(payload))),
        record=bench.record,
        thermal=lambda: ThermalState.unavailable(),
    )


def test_a_model_whose_engine_dir_others_may_write_serves_on_the_fallback(
    bench: Bench, demo_model: Path
) -> None:
    bench.deployed(bench.runtime(), demo_model)
    model = ModelConfig(name="demo", path=demo_model, runtime="tensorrt")
    os.chmod(bench.engine_dir, 0o777)
    slot = ModelSlot(model)
    slot.activate(bench.config(), _sinks(bench, []))
    assert slot.state == "serving" and slot.is_fallback
    assert slot.handle is not None and slot.handle.runtime_label == "onnx_trt_ep"
    (fallback,) = [payload for kind, payload in bench.record.records if kind.startswith("fall")]
    assert fallback["reason"].startswith(
        f"no trusted engine for this host: the engine dir {bench.engine_dir} is writable by "
        "its group and others (mode 0777)"
    )
    assert slot.last_error == fallback["reason"]
    # No build fixes it: a build's ensure_owned_dir refuses the same dir.
    assert slot.fallback_cause == "UnsafeDirectoryError"
    assert slot.fallback_cause not in BUILD_FIXES
    builds: list[dict[str, Any]] = []
    alerts: list[Alert] = []

    def start_build(request: dict[str, Any]) -> dict[str, Any]:
        builds.append(request)
        return {"build_id": "b1"}

    rebuilder = FallbackRebuilder(
        start_build=start_build,
        switch=lambda *_args: {},
        alert=alerts.append,
        can_build=lambda: True,
        backoff_s=0.0,
        max_attempts=3,
    )
    with capture_logs() as logs:
        why = rebuilder.on_fallback("demo", fallback["reason"], slot.fallback_cause)
    assert (builds, alerts) == ([], [])  # before: a build asked, then engine_build_failed
    (skipped,) = [line for line in logs if line["event"] == "engine_rebuild_skipped"]
    assert skipped["cause"] == "UnsafeDirectoryError"
    assert f"the engine dir {bench.engine_dir} is writable by its group" in skipped["reason"]
    assert why == skipped["reason"]
    slot.release()

    os.chmod(bench.engine_dir, 0o750)  # the daemon's own again: trusted
    trusted = ModelSlot(model)
    trusted.activate(bench.config(), _sinks(bench, []))
    assert trusted.handle is not None and trusted.handle.runtime_label == "tensorrt"
    assert not trusted.is_fallback
    trusted.release()


def test_a_symlinked_engine_in_the_engine_dir_is_refused_by_name_before_tensorrt(
    bench: Bench, demo_model: Path, tmp_path: Path
) -> None:
    """It used to pass the gate's five steps and fail the final read with a misleading
    "cannot be re-read after validation"."""
    runtime = bench.runtime()
    entry = bench.deployed(runtime, demo_model)
    engine = entry.artifact_path
    target = tmp_path / "elsewhere.engine"
    engine.rename(target)
    engine.symlink_to(target)
    calls_before = len(bench.gpu.trt.calls)
    with pytest.raises(EngineHashMismatchError) as caught:
        runtime.deserialize_engine(entry)
    assert caught.value.stage == "sidecar" and SYMLINK_REFUSAL in str(caught.value)
    assert "re-read" not in str(caught.value)
    refused = [payload for kind, payload in bench.record.records if kind == "engine_refused"]
    assert refused[-1]["step"] == "sidecar_digest"
    assert "Runtime" not in bench.gpu.trt.calls[calls_before:]
    # Located, it is refused the same way and moved aside (the link, not its target).
    with pytest.raises(EngineMissingError, match="the unusable file was moved to"):
        runtime.compile_engine(demo_model, BuildConfig())
    assert target.is_file() and not os.path.lexists(engine)
