"""A daemon build with the TensorRT builder (the fakes of tests/fakes on the daemon's
``PYTHONPATH``; the build child inherits it) is validated against ONNX Runtime in
the child, trusted in ``<engine_dir>/manifest.json``, and adopted by
``runtime.switch`` (issue 5, items 7 and 8)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.digest import sha256_file
from inferd.engines.sidecar import read_sidecar, sidecar_path
from inferd_client import InferenceClient, OperatorClient
from inferd_client.errors import RemoteError
from tests.conftest import DaemonFactory, wait_until
from tests.fakes.gpu_site import fake_gpu_env
from tests.integration.test_daemon_builds import build_status, control
from tests.integration.test_tensorrt_daemon import expected_descriptors

pytestmark = pytest.mark.integration


def wait_finished(daemon: Any, build_id: str) -> dict[str, Any]:
    statuses: list[dict[str, Any]] = []

    def finished() -> bool:
        statuses.append(build_status(daemon, build_id))
        return statuses[-1]["state"] != "running"

    wait_until(finished, message=f"build {build_id} still running")
    return statuses[-1]


def test_a_daemon_tensorrt_build_validates_and_is_adopted_by_runtime_switch(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    engine_dir = tmp_path / "engines"
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "onnx_trt_ep"}],
        runtime={"engine_dir": str(engine_dir)},
        env=fake_gpu_env({}),
    )
    image = np.random.default_rng(5).random((1, 3, 224, 224), dtype=np.float32)
    with InferenceClient(daemon.infer) as client:
        client.infer("demo", {"image": image})
        assert client.last_reply["runtime"] == "onnx_trt_ep"

    reply = control(daemon, "build.start", model="demo")
    assert reply["result"]["builder"] == "tensorrt" and reply["result"]["simulated"] is False
    status = wait_finished(daemon, str(reply["result"]["build_id"]))
    assert status["state"] == "completed", status["error"]
    assert (status["builder"], status["simulated"]) == ("tensorrt", False)
    assert status["validation_status"] == "pass"

    engine = Path(status["engine_path"])
    assert engine.parent == engine_dir and engine.is_file()
    assert sidecar_path(engine).is_file() and read_sidecar(engine) == sha256_file(engine)
    summary = json.loads(Path(status["summary_path"]).read_text())
    assert summary["outcome"] == "completed" and summary["simulated"] is False
    assert summary["validation"]["status"] == "pass" and summary["eligibleToServe"] is True
    assert summary["baseline"]["outputPath"] == str(engine)

    # Decision (DESIGN.md): a validated daemon build is trusted in <engine_dir>/manifest.json.
    assert status["manifest"] == str(engine_dir / "manifest.json")
    assert status["adoptable"] is True
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["engines"] == {engine.name: summary["baseline"]["engineSha256"]}

    with OperatorClient(daemon.control, timeout=60) as operator:
        switched = operator.call("runtime.switch", model="demo", runtime="tensorrt")
        assert switched["to_runtime"] == "tensorrt"
        (model,) = operator.status()["models"]
    assert model["runtime"] == "tensorrt" and model["fallback"] is False
    with InferenceClient(daemon.infer) as client:
        output = client.infer("demo", {"image": image})["descriptors"]
        assert (client.last_reply["runtime"], client.last_reply["fallback"]) == ("tensorrt", False)
    np.testing.assert_allclose(output, expected_descriptors(demo_model, image), rtol=1e-4)
    # The switch reused the daemon-built engine: nothing else was built.
    assert sorted(p.name for p in engine_dir.glob("*.engine")) == [engine.name]


def test_with_a_deployment_manifest_the_build_is_not_trusted_and_switch_is_refused(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """``runtime.engine_manifest`` set: the daemon never writes it, so the switch is
    refused and the build's status says how an operator adopts the engine."""
    engine_dir, deployed = tmp_path / "engines", tmp_path / "deploy" / "manifest.json"
    deployed.parent.mkdir()
    deployed.write_text(json.dumps({"version": 1, "engines": {}}))
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "onnx_trt_ep"}],
        runtime={"engine_dir": str(engine_dir), "engine_manifest": str(deployed)},
        env=fake_gpu_env({}),
    )
    reply = control(daemon, "build.start", model="demo")
    status = wait_finished(daemon, str(reply["result"]["build_id"]))
    assert (status["state"], status["validation_status"]) == ("completed", "pass")
    assert status["manifest"] is None and status["adoptable"] is False
    assert str(deployed) in status["adoption"] and "--manifest" in status["adoption"]
    assert json.loads(deployed.read_text())["engines"] == {}
    assert not (engine_dir / "manifest.json").exists()
    engine = Path(status["engine_path"])
    with OperatorClient(daemon.control, timeout=60) as operator:
        with pytest.raises(RemoteError) as refused:
            operator.call("runtime.switch", model="demo", runtime="tensorrt")
        assert refused.value.code == "FAILED_PRECONDITION"
        assert "not listed in the deployment manifest" in refused.value.message
        assert str(deployed) in refused.value.message
        (model,) = operator.status()["models"]
        assert model["runtime"] == "onnx_trt_ep"
        # The operator's step: list the engine's digest (its sidecar) in the deployment
        # manifest (what `inferd build --manifest` does), then switch again.
        digest = read_sidecar(engine)
        deployed.write_text(json.dumps({"version": 1, "engines": {engine.name: digest}}))
        switched = operator.call("runtime.switch", model="demo", runtime="tensorrt")
        assert switched["to_runtime"] == "tensorrt"
