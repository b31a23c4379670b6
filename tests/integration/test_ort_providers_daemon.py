"""ONNX Runtime's silent provider degradation and a staged engine, end to end: a real
daemon subprocess whose ``onnxruntime`` is the fake of tests/fakes around the real
one (tests/fakes/ort_env.py) and, for the staged engine, whose ``tensorrt`` and
``pycuda`` are the fake GPU's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inferd_client import InferenceClient, OperatorClient
from inferd_client.errors import RemoteError
from tests.conftest import DaemonFactory, DaemonProcess
from tests.fakes.gpu_site import fake_gpu_env, prebuild_engine
from tests.fakes.ort_env import fake_ort_env
from tests.integration.test_schemas import assert_valid, call

TRT_EP, CUDA_EP, CPU_EP = (
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "CPUExecutionProvider",
)
NO_LIBNVINFER = (
    "[ONNXRuntimeError] : 1 : FAIL : Failed to load library "
    "libonnxruntime_providers_tensorrt.so with error: libnvinfer.so.10: cannot open shared "
    "object file: No such file or directory"
)


def expected_descriptors(model: Path, image: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=[CPU_EP])
    result: np.ndarray = session.run(None, {"image": image})[0]
    return result


def infer_checked(daemon: DaemonProcess, model: Path) -> None:
    image = np.random.default_rng(11).random((1, 3, 224, 224), dtype=np.float32)
    with InferenceClient(daemon.infer) as client:
        output = client.infer("demo", {"image": image})["descriptors"]
    np.testing.assert_allclose(output, expected_descriptors(model, image), rtol=1e-5, atol=1e-6)


def test_a_cuda_only_session_shows_in_status_the_recorder_and_one_alert(
    daemon_factory: DaemonFactory, demo_model: Path
) -> None:
    daemon = daemon_factory(env=fake_ort_env({}, INFERD_FAKE_ORT_TRT_CREATION_ERROR=NO_LIBNVINFER))
    infer_checked(daemon, demo_model)
    reply, _frames = call(daemon.control, {"v": 1, "id": 1, "op": "status"})
    assert_valid("status_reply.json#/$defs/ok", reply)
    (model,) = reply["result"]["models"]
    assert (model["state"], model["runtime"]) == ("serving", "onnx_trt_ep")
    assert model["fallback"] is False
    assert model["requested_providers"] == [TRT_EP, CUDA_EP, CPU_EP]
    assert model["active_providers"] == [CUDA_EP, CPU_EP]
    assert model["provider_degradation"] == "no_tensorrt_ep"
    assert daemon.stop() == 0, daemon.log()

    records = daemon.fdr_records()
    degraded = [r.payload for r in records if r.kind == "provider_degraded"]
    assert degraded == [
        {
            "model": "demo",
            "degradation": "no_tensorrt_ep",
            "requested": [TRT_EP, CUDA_EP, CPU_EP],
            "active": [CUDA_EP, CPU_EP],
            "missing": {TRT_EP: "not_created"},
            "refused": False,
            "staged_engine_unused": None,
        }
    ]
    alerts = [
        r.payload for r in records if r.kind == "alert" and r.payload["code"] == "provider_degraded"
    ]
    assert len(alerts) == 1, alerts
    assert alerts[0]["level"] == "WARNING" and alerts[0]["fields"]["model"] == "demo"


def test_require_tensorrt_ep_makes_a_cuda_only_model_unavailable(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(
        runtime={"ort_require_tensorrt_ep": True},
        env=fake_ort_env({}, INFERD_FAKE_ORT_TRT_CREATION_ERROR=NO_LIBNVINFER),
    )
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert model["state"] == "failed"
    assert "runtime.ort_require_tensorrt_ep is set" in model["reason"]
    with InferenceClient(daemon.infer) as client, pytest.raises(RemoteError) as refused:
        client.infer("demo", {"image": np.zeros((1, 3, 224, 224), np.float32)})
    assert refused.value.code == "UNAVAILABLE"
    assert daemon.stop() == 0, daemon.log()
    degraded = [r.payload for r in daemon.fdr_records("provider_degraded")]
    assert [p["refused"] for p in degraded] == [True]


def test_a_staged_engine_serves_through_the_tensorrt_ep(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """The engine `inferd build` trusted, staged for an onnx_trt_ep model: gated by the
    daemon, handed to ONNX Runtime's TensorRT EP as an EP-context model, and served."""
    engine_dir = tmp_path / "engines"
    report = prebuild_engine(demo_model, engine_dir)
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "staged_engines": [report["engine"]]}],
        runtime={"engine_dir": str(engine_dir)},
        env=fake_ort_env(fake_gpu_env({})),
    )
    infer_checked(daemon, demo_model)
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert model["active_providers"] == [TRT_EP, CUDA_EP, CPU_EP]
    assert model["provider_degradation"] is None
    (context,) = (daemon.workdir / "state" / "ort_trt_cache").rglob("staged_*_ctx.onnx")
    assert context.name == f"staged_{report['sha256'][:16]}_ctx.onnx"
    assert daemon.stop() == 0, daemon.log()
    kinds = {r.kind for r in daemon.fdr_records()}
    assert not kinds & {"engine_refused", "provider_degraded"}, kinds


# -- serving never depends on a writable engine cache (issue "security and resource
# limits", point 6) ----------------------------------------------------------------------


@pytest.mark.parametrize("fake_gpu_providers", [False, True], ids=["cpu-build", "trt-ep"])
def test_a_read_only_cache_location_still_serves(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path, fake_gpu_providers: bool
) -> None:
    blocked = tmp_path / "full-disk"
    blocked.write_text("a file where the cache dir's parent should be: mkdir fails")
    daemon = daemon_factory(
        runtime={"ort_trt_cache_dir": str(blocked / "cache")},
        env=fake_ort_env({}) if fake_gpu_providers else None,
    )
    infer_checked(daemon, demo_model)
    reply, _frames = call(daemon.control, {"v": 1, "id": 1, "op": "status"})
    assert_valid("status_reply.json#/$defs/ok", reply)
    (model,) = reply["result"]["models"]
    assert model["state"] == "serving"
    if fake_gpu_providers:
        assert "runtime.ort_trt_cache_dir" in model["engine_cache_error"]
    else:  # only the TensorRT EP caches: nothing to lack
        assert model["engine_cache_error"] is None
    assert daemon.stop() == 0, daemon.log()
    unavailable = daemon.fdr_records("ort_cache_unavailable")
    assert len(unavailable) == (1 if fake_gpu_providers else 0)
