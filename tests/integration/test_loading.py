"""Requests that arrive while a model is still loading (or failing over) wait,
up to their deadline, and are then served: none is dropped."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client import InferenceClient, OperatorClient, RemoteError
from tests.conftest import DaemonFactory, wait_until, write_slow_loading_model


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_slow_loading_model(tmp_path_factory.mktemp("slow") / "slow.onnx")


@pytest.mark.parametrize("runtime", ["onnx_trt_ep", "tensorrt"])
def test_requests_sent_while_loading_are_served_after_load(
    daemon_factory: DaemonFactory, slow_model: Path, runtime: str
) -> None:
    daemon = daemon_factory(
        models=[{"name": "slow", "path": str(slow_model), "runtime": runtime}], wait_ready=False
    )
    with OperatorClient(daemon.control) as operator:
        assert operator.health()["state"] == "starting", "the model must still be loading"
    results: dict[str, Any] = {}

    def send(key: str, inputs: dict[str, np.ndarray], deadline_ms: int | None) -> None:
        with InferenceClient(daemon.infer, timeout=30) as client:
            started = time.monotonic()
            try:
                results[key] = (client.infer("slow", inputs, deadline_ms=deadline_ms), None)
            except RemoteError as exc:
                results[key] = (None, exc)
            results[key + "_s"] = time.monotonic() - started

    value = np.arange(4, dtype=np.float32)
    threads = [
        threading.Thread(target=send, args=("a", {"x": value}, None)),
        threading.Thread(target=send, args=("b", {"x": value + 1}, 30_000)),
        threading.Thread(target=send, args=("late", {"x": value}, 50)),
        threading.Thread(target=send, args=("bad", {"x": np.zeros(5, np.float32)}, None)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    np.testing.assert_array_equal(results["a"][0]["y"], value)
    np.testing.assert_array_equal(results["b"][0]["y"], value + 1)
    # The bus answers an expired deadline while the worker is still loading:
    # before the requests that waited for the load.
    assert results["late"][1] is not None and results["late"][1].code == "DEADLINE_EXCEEDED"
    assert results["late_s"] < min(results["a_s"], results["b_s"])
    # Shape checks need the model's IO spec: done once it has loaded.
    assert results["bad"][1] is not None and results["bad"][1].code == "INVALID_ARGUMENT"
    assert "does not match the model" in results["bad"][1].message
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert model["fallback"] is (runtime == "tensorrt")
    assert model["responses"] == {"OK": 2, "DEADLINE_EXCEEDED": 1, "INVALID_ARGUMENT": 1}


def test_requests_for_a_model_that_fails_to_load_get_unavailable(
    daemon_factory: DaemonFactory, slow_model: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")
    daemon = daemon_factory(
        models=[
            {"name": "slow", "path": str(slow_model)},
            {"name": "broken", "path": str(broken)},
        ],
        wait_ready=False,
    )
    started = time.monotonic()
    with InferenceClient(daemon.infer, timeout=30) as client, pytest.raises(RemoteError) as caught:
        client.infer("broken", {"x": np.zeros(4, np.float32)})
    assert caught.value.code == "UNAVAILABLE"
    assert "broken" in caught.value.message and time.monotonic() - started < 30


def test_a_switch_while_another_model_loads_is_refused_at_once(
    daemon_factory: DaemonFactory, demo_model: Path, slow_model: Path
) -> None:
    """``demo`` serves while ``slow`` still loads: the engine worker takes no swap
    until every model is loaded, so a switch of ``demo`` is refused UNAVAILABLE at
    once (it waited 60 s for an INTERNAL before, DESIGN.md 183)."""
    daemon = daemon_factory(
        models=[
            {"name": "demo", "path": str(demo_model)},
            {"name": "slow", "path": str(slow_model)},
        ],
        wait_ready=False,
    )
    with OperatorClient(daemon.control, timeout=30) as operator:
        wait_until(
            lambda: operator.health()["models"]["demo"]["state"] == "serving",
            message="demo serves",
        )
        with pytest.raises(RemoteError) as refused:  # a client timeout (30 s) before
            operator.call("runtime.switch", model="demo", runtime="onnx_trt_ep")
        health = operator.health()
    assert health["state"] == "starting", "slow must still be loading when the switch is asked"
    assert refused.value.code == "UNAVAILABLE" and "still loading" in refused.value.message
