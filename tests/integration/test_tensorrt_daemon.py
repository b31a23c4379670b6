"""The TensorRT-direct path end to end (the static-shape demo model), in a real
daemon subprocess whose `tensorrt` and `pycuda` are the fakes of tests/fakes
(TensorRT 10.3 API): a
trusted engine serves, an untrusted or broken one fails over, and switching to
and from TensorRT under load loses no request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from inferd_client import InferenceClient, OperatorClient
from tests.conftest import DaemonFactory, DaemonProcess, wait_until
from tests.fakes.gpu_site import fake_gpu_env, prebuild_engine
from tests.integration.load import client_load

FAKE_ENV = fake_gpu_env({})


def trt_daemon(
    daemon_factory: DaemonFactory, model: Path, engine_dir: Path, **env: str
) -> DaemonProcess:
    return daemon_factory(
        models=[{"name": "demo", "path": str(model), "runtime": "tensorrt"}],
        runtime={"engine_dir": str(engine_dir)},
        env={**FAKE_ENV, **env},
    )


def test_a_trusted_engine_serves_on_tensorrt(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    report = prebuild_engine(demo_model, tmp_path / "engines")
    assert Path(report["engine"]).name.endswith(".engine")
    daemon = trt_daemon(daemon_factory, demo_model, tmp_path / "engines")
    image = np.random.default_rng(3).random((1, 3, 224, 224), dtype=np.float32)
    with InferenceClient(daemon.infer) as client:
        output = client.infer("demo", {"image": image})["descriptors"]
        assert (client.last_reply["runtime"], client.last_reply["fallback"]) == ("tensorrt", False)
    np.testing.assert_allclose(output, expected_descriptors(demo_model, image), rtol=1e-5)
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert model["active_providers"] == ["TensorRT"] and model["reason"] is None


def test_an_engine_missing_from_the_manifest_is_refused_and_fails_over(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """An intact engine the daemon's manifest does not list: the gate refuses it at
    step 5 and the model serves on ONNX Runtime, with the refusal and failover
    recorded.  (Background rebuilds off: nothing else is built.)"""
    engine_dir = tmp_path / "engines"
    prebuild_engine(demo_model, engine_dir, manifest=tmp_path / "elsewhere.json")
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "tensorrt"}],
        runtime={"engine_dir": str(engine_dir), "rebuild_on_fallback": False},
        env=FAKE_ENV,
    )
    with InferenceClient(daemon.infer) as client:
        client.infer("demo", {"image": np.zeros((1, 3, 224, 224), np.float32)})
        assert (client.last_reply["runtime"], client.last_reply["fallback"]) == (
            "onnx_trt_ep",
            True,
        )
    assert daemon.stop() == 0
    (refused,) = [r.payload for r in daemon.fdr_records("engine_refused")]
    assert refused["step"] == "manifest_digest"
    (fallback,) = [r.payload for r in daemon.fdr_records("fallback_to_onnx_trt_ep")]
    assert fallback["configured_runtime"] == "tensorrt" and "manifest" in fallback["reason"]
    assert [r.payload for r in daemon.fdr_records("engine_build")] == []


def test_a_warm_up_failure_fails_over(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    prebuild_engine(demo_model, tmp_path / "engines")
    daemon = trt_daemon(
        daemon_factory,
        demo_model,
        tmp_path / "engines",
        INFERD_FAKE_TRT_EXECUTE_ERROR="cudaErrorLaunchFailure",
    )
    with InferenceClient(daemon.infer) as client:
        client.infer("demo", {"image": np.zeros((1, 3, 224, 224), np.float32)})
        assert client.last_reply["fallback"] is True
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert "warm-up" in model["reason"].lower() or "cuda" in model["reason"].lower()


def test_over_budget_fails_over_with_the_reason(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    prebuild_engine(demo_model, tmp_path / "engines")
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "tensorrt"}],
        runtime={"engine_dir": str(tmp_path / "engines"), "gpu_memory_budget_bytes": 1024},
        env=FAKE_ENV,
    )
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert model["fallback"] is True and "budget" in model["reason"]


def test_switching_to_and_from_tensorrt_under_load_loses_nothing(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    prebuild_engine(demo_model, tmp_path / "engines")
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model)}],
        runtime={"engine_dir": str(tmp_path / "engines")},
        env=FAKE_ENV,
    )
    results = []
    with (
        client_load(
            daemon.infer,
            "demo",
            lambda rng: {"image": rng.random((1, 3, 224, 224), dtype=np.float32)},
            lambda _inputs, outputs: (
                outputs["descriptors"].shape == (1, 256, 28, 28)
                and bool(np.isfinite(outputs["descriptors"]).all())
            ),
        ) as load,
        OperatorClient(daemon.control, timeout=60) as operator,
    ):
        for runtime in ("onnx_trt_ep", "tensorrt", "onnx_trt_ep", "tensorrt"):
            # Each switch happens under traffic: some requests answered since the last one.
            answered = sum(load.served.values())
            wait_until(lambda n=answered: sum(load.served.values()) >= n + 5)
            results.append(operator.call("runtime.switch", model="demo", runtime=runtime))
        answered = sum(load.served.values())
        wait_until(lambda: sum(load.served.values()) >= answered + 5)
    failures, served = load.failures, load.served
    assert failures == []
    assert served["tensorrt"] > 0 and served["onnx_trt_ep"] > 0
    assert [r["to_runtime"] for r in results] == [
        "onnx_trt_ep",
        "tensorrt",
        "onnx_trt_ep",
        "tensorrt",
    ]
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert model["runtime"] == "tensorrt"
    assert model["responses"] == {"OK": sum(served.values())}


def expected_descriptors(model: Path, image: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"image": image})[0])


def test_tensorrt_reads_and_writes_a_clients_region_in_place(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """On the (integrated, Orin) fake GPU the region is registered with CUDA and
    TensorRT runs on it directly; the daemon's CUDA rules hold (``no_broken_tensorrt_rules``)
    through the registration, its release when the client goes and shutdown."""
    prebuild_engine(demo_model, tmp_path / "engines")
    daemon = trt_daemon(daemon_factory, demo_model, tmp_path / "engines")
    with InferenceClient(daemon.infer) as client:
        region = client.shared_region(4 * 1024 * 1024)
        image = region.array((1, 3, 224, 224), np.float32)
        image[:] = np.random.default_rng(5).random(image.shape, dtype=np.float32)
        descriptors = region.array((1, 256, 28, 28), np.float32)
        for _ in range(2):
            result = client.infer("demo", {"image": image}, outputs={"descriptors": descriptors})
            assert result["descriptors"] is descriptors
            assert client.last_reply["runtime"] == "tensorrt"
        expected = expected_descriptors(demo_model, np.array(image))
        np.testing.assert_allclose(descriptors, expected, rtol=1e-5)
    with OperatorClient(daemon.control) as operator:
        wait_until(lambda: operator.status()["shm"]["regions"] == [], message="region released")
        assert operator.status()["shm"]["mapped_bytes"] == 0
    assert daemon.stop() == 0
    log = daemon.log()
    assert log.count("shm_region_registered_with_cuda") == 1 and "in_place=True" in log
    assert "cuda_host_unregister_failed" not in log
