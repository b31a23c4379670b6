"""ONNX Runtime's Python session retries a creation that raised with ``['CUDAExecutionProvider',
'CPUExecutionProvider']`` and no provider options, that is on device 0 (the fake models
it: ``tests/fakes/fake_onnxruntime.py``).  With ``runtime.device_id`` other than 0 the
runtime makes the session again with its own options, on the configured device, or
refuses it: a model never serves on a GPU the daemon was not given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inferd.errors import EngineDeserializeError
from inferd.runtime.onnx_trt_ep import CPU_EP, CUDA_EP, TRT_EP
from tests.fakes import fake_onnxruntime
from tests.fakes.fake_onnxruntime import FakeOrt
from tests.unit.runtime.test_ort_providers import (
    LOAD_LIBRARY_FAILED,
    Sinks,
    infer_matches_the_cpu,
    load,
    make_runtime,
)


def served_devices(ort: FakeOrt) -> dict[str, str]:
    """The device of each GPU provider of the last session made."""
    options = ort.sessions[-1]["options"]
    return {name: options[name]["device_id"] for name in (TRT_EP, CUDA_EP) if name in options}


def test_the_retry_on_cuda_keeps_the_configured_device(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    demo_model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ort = fake_onnxruntime.install(
        monkeypatch, FakeOrt(device_count=2, trt_creation_error=LOAD_LIBRARY_FAILED)
    )
    sinks = Sinks()
    runtime = make_runtime(tmp_path, sinks, device_id=1)
    handle = load(runtime, demo_model)
    assert "Falling back to ['CUDAExecutionProvider', 'CPUExecutionProvider']" in (
        capsys.readouterr().out
    )
    assert handle.active_providers == (CUDA_EP, CPU_EP)
    assert served_devices(ort) == {CUDA_EP: "1"}  # ONNX Runtime's retry had it on "0"
    (kind, payload), *_ = sinks.records
    assert (kind, payload["missing"]) == ("provider_degraded", {TRT_EP: "not_created"})
    infer_matches_the_cpu(runtime, handle, demo_model)


def test_a_device_the_host_lacks_never_serves_on_device_0(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model: Path
) -> None:
    """Both GPU providers refuse device 1 of a one-GPU host: ONNX Runtime's retry put
    the CUDA EP on device 0; made again on device 1, it fails and the CPU serves, a
    recorded and alerted degradation (refused with ``ort_disallow_cpu_fallback``)."""
    ort = fake_onnxruntime.install(monkeypatch, FakeOrt(device_count=1))
    sinks = Sinks()
    handle = load(make_runtime(tmp_path, sinks, device_id=1), demo_model)
    assert handle.active_providers == (CPU_EP,)
    assert served_devices(ort) == {}
    (kind, payload), *_ = sinks.records
    assert (kind, payload["degradation"]) == ("provider_degraded", "cpu_only")
    assert payload["missing"] == {TRT_EP: "not_created", CUDA_EP: "not_created"}
    assert [alert.code for alert in sinks.alerts] == ["provider_degraded"]
    fake_onnxruntime.install(monkeypatch, FakeOrt(device_count=1))
    strict = make_runtime(tmp_path, Sinks(), device_id=1, ort_disallow_cpu_fallback=True)
    with pytest.raises(EngineDeserializeError, match="ort_disallow_cpu_fallback"):
        load(strict, demo_model)


@pytest.mark.parametrize(
    ("state", "device_id", "devices"),
    [
        # (ONNX Runtime's retry on device 0 drops the CUDA EP's arena cap, so it is made
        # again too: test_ort_arena_cap.py)
        (FakeOrt(device_count=2), 1, {TRT_EP: "1", CUDA_EP: "1"}),
        (FakeOrt(device_count=2, not_creatable=frozenset({TRT_EP})), 1, {CUDA_EP: "1"}),
    ],
)
def test_a_session_on_the_configured_device_is_made_once(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    demo_model: Path,
    state: FakeOrt,
    device_id: int,
    devices: dict[str, str],
) -> None:
    ort = fake_onnxruntime.install(monkeypatch, state)
    load(make_runtime(tmp_path, Sinks(), device_id=device_id), demo_model)
    assert len(ort.sessions) == 1
    assert served_devices(ort) == devices


def test_a_session_still_on_another_device_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model: Path
) -> None:
    """An ONNX Runtime that puts its GPU providers on device 0 whatever it is told:
    made again once with the runtime's options, then refused, naming both devices."""
    ort = fake_onnxruntime.install(monkeypatch, FakeOrt(device_count=2))
    import onnxruntime

    real = onnxruntime.InferenceSession.get_provider_options

    def on_device_0(session: Any) -> dict[str, dict[str, str]]:
        return {name: {**values, "device_id": "0"} for name, values in real(session).items()}

    monkeypatch.setattr(onnxruntime.InferenceSession, "get_provider_options", on_device_0)
    with pytest.raises(EngineDeserializeError) as refused:
        load(make_runtime(tmp_path, Sinks(), device_id=1), demo_model)
    message = str(refused.value)
    assert "runtime.device_id is 1" in message and f"{TRT_EP} on device 0" in message
    assert len(ort.sessions) == 2


def test_off_device_names_each_gpu_provider_elsewhere() -> None:
    from inferd.runtime.ort_providers import off_device

    options = {TRT_EP: {"device_id": "1"}, CUDA_EP: {"device_id": "0"}, CPU_EP: {}}
    assert off_device(options, 1) == {CUDA_EP: 0}
    assert off_device(options, 0) == {TRT_EP: 1}
    assert off_device({CUDA_EP: {}, CPU_EP: {}}, 1) == {CUDA_EP: 0}  # none given: device 0
    assert off_device({CPU_EP: {}}, 3) == {}
