"""A review of how the gate decides an engine may be loaded: what it reads is bounded,
every malformed input is refused with the gate's own errors (never a crash), the
re-read before deserialization is refused and recorded like the five steps, and the
host tuple names the GPU TensorRT runs on."""

from __future__ import annotations

import hashlib
import os
import sys
import tracemalloc
import types
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd.engines import Manifest, explain, first_failure, read_host_tuple, sidecar_path
from inferd.engines.locate import locate_engine
from inferd.engines.manifest import MANIFEST_NAME, deployment_manifest
from inferd.errors import EngineHashMismatchError, EngineManifestError
from inferd.types import BuildConfig, PrecisionMode
from tests.fakes import fake_pycuda, fake_pynvml
from tests.unit.engines.conftest import CONTENT, HOST, VALID, Deployment, Recorder
from tests.unit.engines.test_host import tensorrt

__all__ = ["tensorrt"]  # the fixture: a tensorrt module that only has its version

CONFIG = BuildConfig(precision=PrecisionMode.FP16)  # what VALID was named for
DIGEST = hashlib.sha256(CONTENT).hexdigest()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A "model" whose SHA-256 is the conftest's ``MODEL_SHA``: VALID is its engine."""
    path = tmp_path / "demo.onnx"
    path.write_bytes(b"the onnx model")
    return path


# -- a symlink loop: refused at step 4, not a RuntimeError ------------------------------------


def _looping_link(directory: Path) -> Path:
    link = directory / VALID
    link.symlink_to(VALID)  # itself: ELOOP
    return link


def test_a_looping_symlink_named_like_an_engine_is_refused_at_the_digest_step(
    deployment: Deployment,
) -> None:
    """``explain`` (``inferd verify``, ``locate_engine``) runs step 5 after step 4 failed;
    the manifest's lookup resolved the path with ``Path.resolve``, which raises
    ``RuntimeError("Symlink loop ...")`` before Python 3.13."""
    link = _looping_link(deployment.directory)
    sidecar_path(link).write_text(f"{DIGEST}  {VALID}\n")
    verdicts = explain(link, host=HOST, manifest=Manifest({VALID: DIGEST}, source="m"))
    failure = first_failure(verdicts)
    assert failure is not None and failure.step == "sidecar_digest"
    assert "is a symbolic link, which inferd does not follow" in failure.message
    assert [v.verdict for v in verdicts] == ["pass", "pass", "pass", "fail", "fail"]
    assert "cannot be read to check it against the deployment manifest" in verdicts[4].message


def test_locate_moves_a_looping_symlink_at_the_engine_path_aside(
    deployment: Deployment, model: Path
) -> None:
    """It raised ``RuntimeError`` out of ``locate_engine`` (so out of the tensorrt
    runtime's ``compile_engine``: a crash, not a failover) and left the link in place."""
    link = _looping_link(deployment.directory)
    plan = locate_engine(
        model, CONFIG, engine_dir=deployment.directory, host=HOST, manifest=lambda: Manifest({})
    )
    assert plan.status == "to_build" and plan.entry.artifact_path == link
    assert plan.quarantined is not None and plan.quarantined.is_symlink()
    assert not os.path.lexists(link)


def test_a_manifest_path_key_naming_a_symlink_loop_is_read(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    manifest = Manifest({f"{loop}/x.engine": DIGEST}, source="m")
    assert manifest.get(loop / "x.engine") == DIGEST
    assert manifest.get(tmp_path / "x.engine") is None


# -- a malformed manifest is EngineManifestError, whatever is wrong with it ---------------------


def _write_daemons_manifest(directory: Path, text: str) -> Path:
    path = directory / MANIFEST_NAME
    path.write_text(text)
    return path


def test_a_manifest_nested_too_deeply_is_malformed(deployment: Deployment) -> None:
    """``json.loads`` raises ``RecursionError``, which every caller let through: they
    catch ``EngineManifestError`` (the builds' output scan, ``_manifest_for_locate``,
    ``inferd verify``)."""
    deep = "[" * 100_000 + "]" * 100_000
    path = _write_daemons_manifest(deployment.directory, f'{{"version": 1, "engines": {deep}}}')
    with pytest.raises(EngineManifestError, match="is malformed: it is nested too deeply"):
        Manifest.load(path)
    with pytest.raises(EngineManifestError, match=str(path)):
        deployment_manifest(None, deployment.directory)


def test_a_manifest_path_key_that_names_no_file_is_malformed(deployment: Deployment) -> None:
    """A JSON escape gives a lone surrogate, which ``os.fsencode`` refuses: the manifest's
    path normalisation raised ``UnicodeEncodeError``."""
    key = "/engines/\\ud800.engine"  # as the JSON text spells it: an escape
    text = f'{{"version": 1, "engines": {{"{key}": "{DIGEST}"}}}}'
    path = _write_daemons_manifest(deployment.directory, text)
    with pytest.raises(EngineManifestError, match="must be a non-empty path or file name"):
        Manifest.load(path)


# -- the re-read: bounded by the gate's size, refused and recorded like a step -----------------


def test_the_reread_refuses_a_file_of_another_size_without_reading_it(
    deployment: Deployment,
) -> None:
    """It allocated and hashed whatever the path held by then: the GPU memory ledger
    charged the gate's size, and a file swapped in since may be any size."""
    engine = deployment.engine()
    validated = deployment.gate().validate(engine)
    big = 64 * 1024 * 1024
    replacement = engine.with_name(".swap")
    with replacement.open("wb") as handle:
        handle.truncate(big)  # sparse: no disk, but 64 MiB for whoever reads it whole
    os.replace(replacement, engine)
    tracemalloc.start()
    try:
        with pytest.raises(EngineHashMismatchError) as refused:
            validated.read_verified()
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024  # 64 MiB before: allocated and read whole, then refused
    assert refused.value.stage == "reread"
    assert f"it has {big} bytes now, {len(CONTENT)} when validated" in str(refused.value)


def test_a_reread_refusal_is_logged_and_recorded_as_the_gates_are(
    deployment: Deployment,
) -> None:
    """A file changed between the gate and the load was refused with no ``engine_refused``
    log line or FDR record: the one refusal that shows a file swapped after the check."""
    engine = deployment.engine()
    recorder = Recorder()
    validated = deployment.gate(record=recorder).validate(engine)
    engine.write_bytes(CONTENT[::-1])  # in place: same inode and size, other bytes
    with capture_logs() as logs, pytest.raises(EngineHashMismatchError) as refused:
        validated.read_verified()
    assert refused.value.stage == "reread"
    reason = str(refused.value)
    assert reason.startswith(f"engine {VALID!r} changed after the gate validated it")
    assert recorder.records == [
        ("engine_refused", {"engine": str(engine), "step": "reread", "reason": reason})
    ]
    lines = [line for line in logs if line["event"] == "engine_refused"]
    assert [(line["step"], line["step_number"], line["error"]) for line in lines] == [
        ("reread", 6, "EngineHashMismatchError")
    ]


def test_an_intact_reread_records_nothing(deployment: Deployment) -> None:
    engine = deployment.engine()
    recorder = Recorder()
    validated = deployment.gate(record=recorder).validate(engine)
    assert bytes(validated.read_verified()) == CONTENT
    assert recorder.records == []
    assert sidecar_path(engine).exists()


# -- the host tuple names the GPU CUDA (and so TensorRT) runs on -------------------------------


def test_with_several_gpus_the_host_tuple_is_cudas_device_not_nvmls_index(
    monkeypatch: pytest.MonkeyPatch, tensorrt: types.ModuleType, tmp_path: Path
) -> None:
    """NVML numbers GPUs by PCI bus and ignores ``CUDA_VISIBLE_DEVICES``; CUDA numbers
    them fastest first.  NVML's device 0 (an RTX 4090 here) named the tuple while CUDA's
    device 0, where TensorRT deserializes, is another GPU: engines for the 4090 passed
    step 2, and builds on the other GPU were named for the 4090."""
    nvml = fake_pynvml.FakeNvml(
        device_count=2, device_name="NVIDIA GeForce RTX 4090", compute_capability=(8, 9)
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(nvml))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cuda = fake_pycuda.install(
        monkeypatch,
        fake_pycuda.FakeCuda(devices=[fake_pycuda.FakeGpu("NVIDIA RTX A2000 12GB", (8, 6))]),
    )
    host = read_host_tuple(precision=PrecisionMode.FP16, tegra_release=tmp_path / "absent")
    assert (host.gpu_sku, host.compute_capability) == ("rtx-a2000-12gb", (8, 6))
    assert "Device.name" in cuda.calls
    assert nvml.init_count == 0 and nvml.shutdown_calls == 1  # NVML given back


def test_with_one_gpu_nvml_still_names_it(
    monkeypatch: pytest.MonkeyPatch, tensorrt: types.ModuleType, tmp_path: Path
) -> None:
    """A Jetson's (or a one-GPU host's) engines keep their names."""
    nvml = fake_pynvml.FakeNvml(device_name="Orin (nvgpu)", compute_capability=(8, 7))
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(nvml))
    cuda = fake_pycuda.install(monkeypatch, fake_pycuda.FakeCuda())
    host = read_host_tuple(precision=PrecisionMode.FP16, tegra_release=tmp_path / "absent")
    assert (host.gpu_sku, host.compute_capability) == ("orin-nvgpu", (8, 7))
    assert cuda.calls == []
