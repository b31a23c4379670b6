"""Serving through a real ``inferd run`` subprocess: correctness under
concurrency, dynamic shapes, REQ peers, describe/status/health, failover to
``onnx_trt_ep`` with its alert, periodic health events and the instance lock."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
import zmq

from inferd_client import EventSubscriber, InferenceClient, OperatorClient, RemoteError
from tests.conftest import (
    REPO,
    DaemonFactory,
    DaemonProcess,
    Events,
    render_config,
    start_daemon,
    wait_until,
)
from tests.integration.wire import IDENTITY_SHAPE, RawDealer, assert_error, pack

pytestmark = pytest.mark.integration

FALLBACK_CODE = "fallback_to_onnx_trt_ep"


def _models(demo_model: Path, identity_model: Path) -> list[dict[str, object]]:
    return [
        {"name": "demo", "path": str(demo_model)},
        {"name": "identity", "path": str(identity_model)},
    ]


@pytest.fixture(scope="module")
def shared_daemon(demo_model: Path, identity_model: Path) -> Iterator[DaemonProcess]:
    """One daemon serving ``demo`` and ``identity`` for the read-only tests here."""
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    daemon = start_daemon(render_config(workdir, _models(demo_model, identity_model)), workdir)
    yield daemon
    assert daemon.stop() == 0, daemon.log()
    shutil.rmtree(workdir, ignore_errors=True)


def _identity_input(rng: np.random.Generator, batch: int = 1) -> np.ndarray:
    return rng.standard_normal((batch, *IDENTITY_SHAPE[1:]), dtype=np.float32)


# -- correctness -----------------------------------------------------------------
def test_concurrent_clients_each_get_their_own_outputs(shared_daemon: DaemonProcess) -> None:
    threads, per_thread = 8, 50
    failures: list[str] = []
    completed = [0] * threads
    start = threading.Barrier(threads)

    def worker(index: int) -> None:
        rng = np.random.default_rng(1000 + index)
        try:
            with InferenceClient(shared_daemon.infer, timeout=30) as client:
                start.wait(timeout=10)
                for number in range(per_thread):
                    image = _identity_input(rng)
                    # A tag in the first element makes every request distinct.
                    image[0, 0, 0, 0] = index * 1000 + number
                    output = client.infer("identity", {"input": image})["output"]
                    if output.shape != image.shape or not np.array_equal(output, image):
                        failures.append(f"thread {index} request {number}: output differs")
                        return
                    completed[index] += 1
                assert client.discarded_replies == 0
        except BaseException as exc:
            failures.append(f"thread {index}: {exc!r}")

    pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in pool), "a client thread hung"
    assert failures == []
    assert completed == [per_thread] * threads


def test_demo_outputs_equal_in_process_onnxruntime(
    shared_daemon: DaemonProcess, demo_model: Path
) -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(demo_model), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    inputs = [
        rng.random((1, 3, 224, 224), dtype=np.float32),
        rng.standard_normal((1, 3, 224, 224), dtype=np.float32) * 10,
        np.zeros((1, 3, 224, 224), np.float32),
    ]
    with InferenceClient(shared_daemon.infer) as client:
        for image in inputs:
            expected = session.run(None, {"image": image})[0]
            outputs = client.infer("demo", {"image": image})
            assert list(outputs) == ["descriptors"]
            assert outputs["descriptors"].dtype == np.float32
            np.testing.assert_array_equal(outputs["descriptors"], expected)
            reply = client.last_reply
            assert reply["ok"] is True and reply["model"] == "demo"
            assert reply["runtime"] == "onnx_trt_ep" and reply["fallback"] is False
            assert isinstance(reply["latency_us"], int) and reply["latency_us"] > 0


def test_dynamic_batch_dimension(shared_daemon: DaemonProcess) -> None:
    rng = np.random.default_rng(3)
    with InferenceClient(shared_daemon.infer) as client:
        for batch in (2, 3):
            images = _identity_input(rng, batch)
            output = client.infer("identity", {"input": images})["output"]
            assert output.shape == (batch, 3, 224, 224)
            np.testing.assert_array_equal(output, images)
            assert client.last_reply["outputs"] == [
                {"name": "output", "dtype": "float32", "shape": [batch, 3, 224, 224]}
            ]
        with pytest.raises(RemoteError) as raised:
            client.infer("identity", {"input": np.zeros((1, 3, 224, 225), np.float32)})
        assert raised.value.code == "INVALID_ARGUMENT"
        assert "[1, 3, 224, 225]" in raised.value.message
        assert "['?', 3, 224, 224]" in raised.value.message


def test_req_socket_gets_a_correct_reply(shared_daemon: DaemonProcess) -> None:
    image = _identity_input(np.random.default_rng(5))
    header = {
        "v": 1,
        "id": "req-1",
        "op": "infer",
        "model": "identity",
        "inputs": [{"name": "input", "dtype": "float32", "shape": list(image.shape)}],
    }
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(shared_daemon.infer)
    try:
        for request_id in ("req-1", 42):
            header["id"] = request_id
            sock.send_multipart([pack(header), image.tobytes()])
            assert sock.poll(5000, zmq.POLLIN), "REQ socket got no reply"
            parts = sock.recv_multipart()
            reply = msgpack.unpackb(parts[0], raw=False)
            assert reply["ok"] is True and reply["id"] == request_id
            assert len(parts) == 2
            output = np.frombuffer(parts[1], np.float32).reshape(reply["outputs"][0]["shape"])
            np.testing.assert_array_equal(output, image)
    finally:
        sock.close(linger=0)


def test_describe_lists_models_with_io_specs(shared_daemon: DaemonProcess) -> None:
    with InferenceClient(shared_daemon.infer) as client:
        result = client.describe()
    models = {model["name"]: model for model in result["models"]}
    assert set(models) == {"demo", "identity"}
    assert models["demo"]["state"] == "serving"
    assert models["demo"]["inputs"] == [
        {"name": "image", "dtype": "float32", "shape": [1, 3, 224, 224]}
    ]
    assert models["demo"]["outputs"] == [
        {"name": "descriptors", "dtype": "float32", "shape": [1, 256, 28, 28]}
    ]
    assert models["identity"]["inputs"] == [
        {"name": "input", "dtype": "float32", "shape": [None, 3, 224, 224]}
    ]
    assert models["identity"]["outputs"] == [
        {"name": "output", "dtype": "float32", "shape": [None, 3, 224, 224]}
    ]


def test_describe_echoes_the_id_on_a_raw_dealer(shared_daemon: DaemonProcess) -> None:
    with RawDealer(shared_daemon.infer) as dealer:
        header, frames = dealer.request([pack({"v": 1, "id": "d-7", "op": "describe"})])
    assert header["ok"] is True and header["id"] == "d-7" and frames == []
    assert {model["name"] for model in header["result"]["models"]} == {"demo", "identity"}


# -- status and health -------------------------------------------------------------
def test_status_counts_requests_by_code_and_reports_latency(
    daemon_factory: DaemonFactory, demo_model: Path, identity_model: Path
) -> None:
    daemon = daemon_factory(models=_models(demo_model, identity_model))
    rng = np.random.default_rng(9)
    with InferenceClient(daemon.infer) as client:
        for _ in range(6):
            client.infer("identity", {"input": _identity_input(rng)})
        for bad in (np.zeros((1, 3, 2, 2), np.float32), np.zeros((1, 3, 224, 224), np.float64)):
            with pytest.raises(RemoteError, match="INVALID_ARGUMENT"):
                client.infer("identity", {"input": bad})
        with pytest.raises(RemoteError, match="NOT_FOUND"):
            client.infer("nope", {"input": _identity_input(rng)})

    with OperatorClient(daemon.control) as operator:
        status = operator.status()
        health = operator.health()
    assert status["daemon"]["state"] == "serving"
    assert status["daemon"]["pid"] == daemon.process.pid
    models = {model["model"]: model for model in status["models"]}
    identity, demo = models["identity"], models["demo"]
    assert identity["requests"] == 8
    assert identity["responses"] == {"OK": 6, "INVALID_ARGUMENT": 2}
    assert identity["errors"] == 2
    latency = identity["latency_us"]
    assert latency["window"] == 6
    assert 0 < latency["p50"] <= latency["p99"]
    assert identity["queue_depth"] == 0 and identity["queue_capacity"] == 64
    assert identity["runtime"] == "onnx_trt_ep" and identity["fallback"] is False
    assert demo["requests"] == 0 and demo["responses"] == {} and demo["latency_us"]["window"] == 0
    # Refusals before admission (unknown model, bad tensors) count as malformed on the bus.
    assert status["bus"]["malformed"] == 3
    assert status["bus"]["events_published"] > 0

    assert health["state"] == "serving"
    assert health["threads"] == {"engine_worker": True, "bus": True, "publisher": True}
    assert health["models"]["identity"] == {
        "state": "serving",
        "runtime": "onnx_trt_ep",
        "fallback": False,
        "queue_depth": 0,
    }
    assert health["uptime_s"] > 0


def test_health_events_arrive_periodically(shared_daemon: DaemonProcess) -> None:
    events: list[dict[str, Any]] = []
    with EventSubscriber(shared_daemon.events, topics=["health"]) as subscriber:
        give_up_at = time.monotonic() + 5
        while len(events) < 4 and time.monotonic() < give_up_at:
            event = subscriber.receive(timeout=1.0)
            if event is not None:
                topic, payload = event
                assert topic == "health"
                events.append(payload)
    assert len(events) == 4, f"only {len(events)} health events in 5 s (interval 0.2 s)"
    for payload in events:
        assert payload["state"] == "serving"
        assert set(payload["models"]) == {"demo", "identity"}
        assert payload["threads"]["engine_worker"] is True
    sequence = [payload["seq"] for payload in events]
    assert sequence == sorted(sequence) and len(set(sequence)) == 4
    gaps_s = np.diff([payload["ts_ns"] for payload in events]) / 1e9
    assert all(0.1 < gap < 1.5 for gap in gaps_s), gaps_s


# -- failover ------------------------------------------------------------------------
def test_tensorrt_model_fails_over_to_onnx_with_one_alert(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    daemon = daemon_factory(
        models=[{"name": "identity", "path": str(identity_model), "runtime": "tensorrt"}]
    )
    rng = np.random.default_rng(21)
    with Events(daemon.events, topics=["alert"]) as subscriber:
        with InferenceClient(daemon.infer) as client:
            for _ in range(5):
                image = _identity_input(rng)
                np.testing.assert_array_equal(
                    client.infer("identity", {"input": image})["output"], image
                )
                assert client.last_reply["fallback"] is True
                assert client.last_reply["runtime"] == "onnx_trt_ep"
        # Every alert the five requests raised, up to a later marker event.
        events = subscriber.settle()
    fallback_alerts = [p for topic, p in events if topic == "alert" and p["code"] == FALLBACK_CODE]
    assert len(fallback_alerts) == 1, events
    assert fallback_alerts[0]["level"] == "WARNING"
    assert "onnx" in fallback_alerts[0]["message"].lower()
    assert fallback_alerts[0]["fields"]["model"] == "identity"

    with OperatorClient(daemon.control) as operator:
        status = operator.status()
        health = operator.health()
    (model,) = status["models"]
    assert model["configured_runtime"] == "tensorrt"
    assert model["runtime"] == "onnx_trt_ep"
    assert model["fallback"] is True
    assert model["state"] == "serving"
    assert "tensorrt" in model["reason"]
    assert model["responses"] == {"OK": 5}
    assert health["state"] == "degraded"
    assert health["models"]["identity"]["fallback"] is True


def test_tensorrt_disabled_by_runtime_enabled_fails_over(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    daemon = daemon_factory(
        models=[{"name": "identity", "path": str(identity_model), "runtime": "tensorrt"}],
        runtime={"enabled": ["onnx_trt_ep"]},
    )
    image = _identity_input(np.random.default_rng(22))
    with InferenceClient(daemon.infer) as client:
        np.testing.assert_array_equal(client.infer("identity", {"input": image})["output"], image)
        assert client.last_reply["fallback"] is True
        assert client.last_reply["runtime"] == "onnx_trt_ep"
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert model["fallback"] is True
    assert "disabled by runtime.enabled" in model["reason"]


# -- instance lock ---------------------------------------------------------------------
def test_second_daemon_on_the_same_runtime_dir_refuses_to_start(
    daemon: DaemonProcess, demo_model: Path, tmp_path: Path
) -> None:
    run_dir = daemon.workdir / "run"
    config = render_config(
        tmp_path,
        [{"name": "demo", "path": str(demo_model)}],
        daemon={"runtime_dir": str(run_dir)},
        bus={
            "infer_endpoint": daemon.infer,
            "control_endpoint": daemon.control,
            "events_endpoint": daemon.events,
        },
    )
    config_path = tmp_path / "second.toml"
    config_path.write_text(config)
    second = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli", "run", "--config", str(config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        _, stderr = second.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        second.kill()
        _, stderr = second.communicate()
        pytest.fail(f"the second daemon did not refuse to start:\n{stderr}")
    assert second.returncode == 1, stderr
    assert "cannot start" in stderr
    assert "another inferd holds" in stderr
    assert str(run_dir / "inferd.lock") in stderr

    # The first daemon still owns its sockets and serves.
    image = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)
    with InferenceClient(daemon.infer) as client:
        assert client.infer("demo", {"image": image})["descriptors"].shape == (1, 256, 28, 28)
    with OperatorClient(daemon.control) as operator:
        assert operator.status()["daemon"]["pid"] == daemon.process.pid
    assert daemon.process.poll() is None
    wait_until(lambda: (run_dir / "inferd.lock").exists(), 1, message="lock file kept")


def test_unknown_model_error_on_raw_dealer(shared_daemon: DaemonProcess) -> None:
    image = np.zeros(IDENTITY_SHAPE, np.float32)
    with RawDealer(shared_daemon.infer) as dealer:
        dealer.send_infer(77, "missing", {"input": image})
        header, frames = dealer.recv()
    assert_error(header, "NOT_FOUND", "no model named 'missing'", 77)
    assert "['demo', 'identity']" in header["error"]["message"]
    assert frames == []


def test_model_that_cannot_load_is_unavailable_and_others_serve(
    daemon_factory: DaemonFactory, identity_model: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"this is not an onnx model")
    daemon = daemon_factory(
        models=[
            {"name": "identity", "path": str(identity_model)},
            {"name": "broken", "path": str(broken)},
        ]
    )
    with OperatorClient(daemon.control) as operator:
        health = operator.health()
        models = {model["model"]: model for model in operator.status()["models"]}
    assert health["state"] == "degraded"
    assert health["models"]["broken"]["state"] == "failed"
    assert models["broken"]["runtime"] is None
    assert "broken.onnx" in models["broken"]["reason"]
    image = _identity_input(np.random.default_rng(4))
    with InferenceClient(daemon.infer) as client:
        with pytest.raises(RemoteError) as raised:
            client.infer("broken", {"input": image})
        assert raised.value.code == "UNAVAILABLE"
        assert "model 'broken' is failed" in raised.value.message
        np.testing.assert_array_equal(client.infer("identity", {"input": image})["output"], image)
