"""Serve while the engine is built (the one engine pipeline, end to end), in a
real daemon subprocess on the TensorRT 10.3 / pycuda fakes of tests/fakes.

A model configured for ``tensorrt`` whose engine is missing serves on
``onnx_trt_ep`` at once, marked fallback; its engine is built in a build child
(events on the ``build`` topic); a validated, trusted build is adopted
make-before-break with no failed request.  A cancelled or failed build, or one
a deployment manifest does not list, leaves the model on the fallback with an
alert saying why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client import InferenceClient, OperatorClient
from tests.conftest import DaemonFactory, DaemonProcess, Events, wait_until
from tests.fakes.gpu_site import fake_gpu_env
from tests.integration.load import client_load
from tests.integration.test_daemon_builds import build_status, control
from tests.integration.test_schemas import assert_valid
from tests.integration.test_tensorrt_daemon import expected_descriptors

pytestmark = pytest.mark.integration

#: Slow enough to subscribe and to cancel mid-build (about ten fake build steps).
SLOW_BUILD = {"INFERD_FAKE_TRT_BUILD_STEP_S": "0.15"}


def start(
    daemon_factory: DaemonFactory,
    demo_model: Path,
    engine_dir: Path,
    env: dict[str, str],
    **runtime: Any,
) -> DaemonProcess:
    return daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "tensorrt"}],
        runtime={"engine_dir": str(engine_dir), **runtime},
        env=fake_gpu_env(env),
    )


def the_build(daemon: DaemonProcess) -> dict[str, Any]:
    """The one build the daemon started for ``demo``."""
    reply = control(daemon, "build.status")
    builds = [b for b in reply["result"]["builds"] if b["model"] == "demo"]
    assert len(builds) == 1, daemon.log()[-3000:]
    (build,) = builds
    assert build["requested_by"] == "inferd: engine missing"
    return dict(build)


def model_status(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    return dict(model)


def rebuild_status(daemon: DaemonProcess) -> dict[str, Any]:
    """``status.builds.rebuilds`` (the reply checked against its schema)."""
    reply = control(daemon, "status")
    assert_valid("status_reply.json", reply)
    rebuilds = reply["result"]["builds"]["rebuilds"]
    assert rebuilds["enabled"] is True
    return dict(rebuilds)


def alert(events: Events, code: str) -> dict[str, Any]:
    return events.next(
        lambda topic, payload: topic == "alert" and payload.get("code") == code, code
    )


def test_serves_on_the_fallback_at_once_then_adopts_the_built_engine_under_load(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    engine_dir = tmp_path / "engines"
    daemon = start(daemon_factory, demo_model, engine_dir, SLOW_BUILD)
    events = Events(daemon.events, topics=("build", "runtime"))
    # Ready (the factory waited for it) while the build runs: start-up never waits.
    running = the_build(daemon)
    assert running["state"] == "running"
    rebuild = rebuild_status(daemon)["models"]["demo"]
    assert (rebuild["state"], rebuild["build_id"]) == ("building", running["build_id"])
    model = model_status(daemon)
    assert (model["runtime"], model["fallback"]) == ("onnx_trt_ep", True)
    assert "no engine for this host" in model["reason"]

    image = np.random.default_rng(11).random((1, 3, 224, 224), dtype=np.float32)
    with client_load(
        daemon.infer,
        "demo",
        lambda rng: {"image": rng.random((1, 3, 224, 224), dtype=np.float32)},
        lambda _inputs, outputs: bool(np.isfinite(outputs["descriptors"]).all()),
    ) as load:
        step = events.next(lambda topic, p: topic == "build" and p["type"] == "step", "a step")
        assert_valid("event_build.json", step)
        completed = events.next(
            lambda topic, p: topic == "build" and p["type"] == "completed", "build completed"
        )
        switched = events.next(
            lambda topic, p: topic == "runtime" and p["runtime"] == "tensorrt", "the switch"
        )
        assert switched["fallback"] is False and switched["reason"] is None
        wait_until(
            lambda: rebuild_status(daemon)["models"]["demo"]["state"] == "adopted",
            message="the rebuild shown adopted in status",
        )
        wait_until(lambda: load.served["tensorrt"] >= 5, message="requests served on tensorrt")
    assert load.failures == []
    assert load.served["onnx_trt_ep"] > 0 and load.served["tensorrt"] >= 5
    assert completed["buildId"] == step["buildId"]

    with InferenceClient(daemon.infer) as client:
        output = client.infer("demo", {"image": image})["descriptors"]
        assert (client.last_reply["runtime"], client.last_reply["fallback"]) == ("tensorrt", False)
    np.testing.assert_allclose(output, expected_descriptors(demo_model, image), rtol=1e-4)
    build = the_build(daemon)
    assert build["validation_status"] == "pass" and build["manifest"] is not None
    assert daemon.stop() == 0
    (record,) = [r.payload for r in daemon.fdr_records("runtime_switch")]
    assert (record["from_runtime"], record["to_runtime"]) == ("onnx_trt_ep", "tensorrt")
    assert record["requested_by"] == f"inferd: build {build['build_id']}"
    assert record["outcome"] == "switched"


def test_a_cancelled_build_leaves_the_model_on_the_fallback_with_an_alert(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    daemon = start(
        daemon_factory, demo_model, tmp_path / "engines", {"INFERD_FAKE_TRT_BUILD_STEP_S": "0.5"}
    )
    events = Events(daemon.events, topics=("alert",))
    build_id = the_build(daemon)["build_id"]
    assert control(daemon, "build.cancel", build_id=build_id)["result"]["accepted"] is True
    raised = alert(events, "engine_build_cancelled")
    assert raised["level"] == "WARNING" and build_id in raised["message"]
    assert build_status(daemon, build_id)["state"] == "cancelled"
    model = model_status(daemon)
    assert (model["runtime"], model["fallback"]) == ("onnx_trt_ep", True)
    assert not list((tmp_path / "engines").glob("*.engine"))
    # Not retried: an operator stopped it.
    assert [b["build_id"] for b in control(daemon, "build.status")["result"]["builds"]] == [
        build_id
    ]


def test_a_failed_build_backs_off_then_gives_up_with_an_alert(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    daemon = start(
        daemon_factory,
        demo_model,
        tmp_path / "engines",
        {"INFERD_FAKE_TRT_BUILD_ERROR": "2: Error Code 2: OutOfMemory (no further information)"},
        rebuild_backoff_s=0.2,
        rebuild_max_attempts=2,
    )
    events = Events(daemon.events, topics=("alert",))
    first = alert(events, "engine_build_failed")
    second = alert(events, "engine_build_gave_up")
    assert first["level"] == "WARNING" and "retry 2 of 2" in first["message"]
    assert second["level"] == "ERROR" and "giving up after 2 build(s)" in second["message"]
    assert "out of memory" in second["message"]
    builds = control(daemon, "build.status")["result"]["builds"]
    assert [b["state"] for b in builds] == ["failed", "failed"]
    rebuilds = rebuild_status(daemon)
    assert (rebuilds["max_attempts"], rebuilds["backoff_s"]) == (2, 0.2)
    rebuild = rebuilds["models"]["demo"]
    assert (rebuild["state"], rebuild["attempts"], rebuild["build_id"]) == ("gave_up", 2, None)
    running_limit = control(daemon, "status")["result"]["builds"]["running_limit"]
    assert running_limit == {"max_running": 2, "running": 0, "refused": 0}
    model = model_status(daemon)
    assert (model["runtime"], model["fallback"], model["state"]) == ("onnx_trt_ep", True, "serving")


def test_with_a_deployment_manifest_the_new_engine_awaits_approval(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    deployed = tmp_path / "deploy" / "manifest.json"
    deployed.parent.mkdir()
    deployed.write_text(json.dumps({"version": 1, "engines": {}}))
    daemon = start(
        daemon_factory,
        demo_model,
        tmp_path / "engines",
        SLOW_BUILD,
        engine_manifest=str(deployed),
    )
    events = Events(daemon.events, topics=("alert",))
    raised = alert(events, "engine_awaiting_approval")
    assert str(deployed) in raised["message"] and "--manifest" in raised["message"]
    engine = Path(the_build(daemon)["engine_path"])
    assert engine.name in raised["message"]
    assert json.loads(deployed.read_text())["engines"] == {}  # never written by the daemon
    model = model_status(daemon)
    assert (model["runtime"], model["fallback"]) == ("onnx_trt_ep", True)
