"""Operator runtime switching: make-before-break, with clients sending throughout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client import InferenceClient, OperatorClient, RemoteError
from tests.conftest import (
    DaemonFactory,
    DaemonProcess,
    Events,
    wait_until,
    write_slow_loading_model,
)
from tests.integration.load import client_load
from tests.integration.test_schemas import assert_valid
from tests.integration.wire import RawDealer, pack


def identity_models(identity_model: Path, runtime: str = "onnx_trt_ep") -> list[dict[str, object]]:
    return [{"name": "identity", "path": str(identity_model), "runtime": runtime}]


def switch(daemon: DaemonProcess, model: str, runtime: str, timeout: float = 60) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=timeout) as operator:
        return operator.call("runtime.switch", model=model, runtime=runtime, requested_by="test")


def test_switching_under_load_loses_no_request(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    daemon = daemon_factory(models=identity_models(identity_model))
    with client_load(
        daemon.infer,
        "identity",
        lambda rng: {"input": rng.random((1, 3, 224, 224), dtype=np.float32)},
        lambda inputs, outputs: np.array_equal(outputs["output"], inputs["input"]),
    ) as load:
        # Switch while the clients are being served (20 replies in) and keep
        # them sending after the last swap, until 20 more replies came back.
        wait_until(lambda: sum(load.served.values()) >= 20, message="the load running")
        results = [switch(daemon, "identity", "onnx_trt_ep") for _ in range(3)]
        served = sum(load.served.values())
        wait_until(lambda: sum(load.served.values()) >= served + 20, message="load after")
    failures, outcomes = load.failures, load.served
    assert failures == []
    assert set(outcomes) == {"onnx_trt_ep"} and sum(outcomes.values()) > 20
    for result in results:
        assert_valid("switch_reply.json#/$defs/ok", {"v": 1, "id": 1, "ok": True, "result": result})
        assert (result["from_runtime"], result["to_runtime"]) == ("onnx_trt_ep", "onnx_trt_ep")
        assert result["prepare_ms"] > 0 and result["swap_ms"] >= 0
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert set(model["responses"]) == {"OK"}
    assert model["responses"]["OK"] == sum(outcomes.values())


def test_refused_switch_keeps_the_old_runtime_and_is_recorded(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    rate = {"switch_burst": 3, "switch_refill_s": 3600}  # a token an hour: none comes back
    daemon = daemon_factory(models=identity_models(identity_model), runtime=rate)
    refusals = []
    for _ in range(3):  # a script in a loop: each refused alike, recorded once
        with pytest.raises(RemoteError) as caught:
            switch(daemon, "identity", "tensorrt")
        refusals.append((caught.value.code, caught.value.message))
    assert len(set(refusals)) == 1
    assert caught.value.code == "FAILED_PRECONDITION"
    assert "cannot prepare tensorrt" in caught.value.message
    assert "onnx_trt_ep keeps serving" in caught.value.message
    # Past the peer's burst: refused before preparing, not recorded, counted.
    with pytest.raises(RemoteError) as limited:
        switch(daemon, "identity", "tensorrt")
    assert limited.value.code == "RESOURCE_EXHAUSTED"
    assert "runtime.switch rate limit for uid" in limited.value.message
    assert "retry after" in limited.value.message
    with OperatorClient(daemon.control) as operator:
        status = operator.status()
    assert status["security"]["switch_limit"] == {"burst": 3, "refill_s": 3600.0, "refused": 1}
    assert_valid("status_reply.json#/$defs/ok", {"v": 1, "id": 1, "ok": True, "result": status})
    with InferenceClient(daemon.infer) as client:
        client.infer("identity", {"input": np.zeros((1, 3, 224, 224), np.float32)})
        assert client.last_reply["runtime"] == "onnx_trt_ep"
    assert daemon.stop() == 0
    records = daemon.fdr_records("runtime_switch")
    assert [(r.payload["outcome"], r.payload["requested_by"]) for r in records] == [
        ("refused", "test")
    ]
    (repeats,) = daemon.fdr_records("runtime_switch_refusals")  # counted until the stop
    assert (repeats.payload["count"], repeats.payload["reason"]) == (2, caught.value.message)


def test_switching_a_failed_over_model_clears_the_fallback(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    daemon = daemon_factory(models=identity_models(identity_model, runtime="tensorrt"))
    image = np.zeros((1, 3, 224, 224), np.float32)
    with Events(daemon.events, topics=["runtime"]) as events:
        with InferenceClient(daemon.infer) as client:
            client.infer("identity", {"input": image})
            assert client.last_reply["fallback"] is True
            result = switch(daemon, "identity", "onnx_trt_ep")
            client.infer("identity", {"input": image})
            assert client.last_reply["fallback"] is False
        event = events.next(lambda topic, _payload: topic == "runtime", "runtime (switched)")
    assert result["from_runtime"] == "onnx_trt_ep" and result["to_runtime"] == "onnx_trt_ep"
    assert event["fallback"] is False and event["reason"] is None
    with OperatorClient(daemon.control) as operator:
        (model,) = operator.status()["models"]
    assert model["fallback"] is False and model["configured_runtime"] == "tensorrt"
    assert daemon.stop() == 0
    (record,) = daemon.fdr_records("runtime_switch")
    assert record.payload["outcome"] == "switched"
    assert record.payload["prepare_ms"] > 0


def test_switch_argument_errors(daemon_factory: DaemonFactory, identity_model: Path) -> None:
    daemon = daemon_factory(models=identity_models(identity_model))
    cases = [
        ({"model": "nope", "runtime": "onnx_trt_ep"}, "NOT_FOUND"),
        ({"model": "identity", "runtime": "cuda"}, "INVALID_ARGUMENT"),
        ({"model": "identity"}, "INVALID_ARGUMENT"),
        ({"model": "identity", "runtime": "onnx_trt_ep", "requested_by": ""}, "INVALID_ARGUMENT"),
    ]
    with OperatorClient(daemon.control) as operator:
        for arguments, code in cases:
            with pytest.raises(RemoteError) as caught:
                operator.call("runtime.switch", **arguments)
            assert caught.value.code == code, arguments


def test_a_second_switch_while_one_prepares_is_refused(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    slow = write_slow_loading_model(tmp_path / "slow.onnx")
    daemon = daemon_factory(models=[{"name": "slow", "path": str(slow)}])
    # Both requests on one connection: the bus takes them in order, so the second
    # one arrives while the first is preparing (loading takes over a second).
    with RawDealer(daemon.control) as dealer:
        for request_id in ("first", "second"):
            header = {
                "v": 1,
                "id": request_id,
                "op": "runtime.switch",
                "model": "slow",
                "runtime": "onnx_trt_ep",
                "requested_by": "test",
            }
            dealer.send([pack(header)])
        replies = [dealer.recv(timeout=60)[0] for _ in range(2)]
    # The refusal is immediate: it comes before the first switch's result.
    second, first = replies
    assert second["id"] == "second" and second["ok"] is False, second
    assert second["error"]["code"] == "FAILED_PRECONDITION"
    assert "in progress" in second["error"]["message"]
    assert first["id"] == "first" and first["ok"] is True, first
    assert first["result"]["to_runtime"] == "onnx_trt_ep"


def test_inferctl_switch(daemon_factory: DaemonFactory, identity_model: Path) -> None:
    daemon = daemon_factory(models=identity_models(identity_model))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferd_client.cli",
            "--control-endpoint",
            daemon.control,
            "--timeout",
            "60",
            "--json",
            "switch",
            "identity",
            "onnx_trt_ep",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["to_runtime"] == "onnx_trt_ep"


def test_a_switch_preparing_when_the_daemon_stops_is_answered(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """SIGTERM while a switch prepares: the operator is told UNAVAILABLE (or, had
    the switch finished first, its result) before the daemon exits; never nothing."""
    slow = write_slow_loading_model(tmp_path / "slow.onnx", nodes=40_000)
    daemon = daemon_factory(models=[{"name": "slow", "path": str(slow)}])
    with RawDealer(daemon.control) as dealer:
        header = {"v": 1, "id": "s", "op": "runtime.switch", "model": "slow"}
        dealer.send([pack({**header, "runtime": "onnx_trt_ep", "requested_by": "test"})])
        wait_until(lambda: "runtime_switch_preparing" in daemon.log(), message="preparing")
        assert daemon.stop() == 0
        reply, _frames = dealer.recv(timeout=5)
    assert reply["id"] == "s", reply
    if not reply["ok"]:
        assert reply["error"]["code"] == "UNAVAILABLE", reply
        assert "not switched" in reply["error"]["message"]
