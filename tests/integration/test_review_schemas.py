"""What the daemon sends against what ``schemas/bus/`` and the documents say of it,
where a review found them apart (each case drives a real daemon).

* ``daemon_state`` (``health``, ``status.daemon.state``, the ``health`` event):
  ``serving`` while every model serves and none on the fallback, ``degraded``
  otherwise, as the models serve now, not as they did once the daemon was ready.
* ``event_alert.json`` pins the fields of every code the daemon raises.
* ``control_request.json`` holds ``build.start``'s arguments to the daemon's bounds.
"""

from __future__ import annotations

import os
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import HANG_S, DaemonFactory, DaemonProcess, Events
from tests.fakes import fake_tensorrt
from tests.fakes.gpu_site import fake_gpu_env
from tests.fakes.ort_env import fake_ort_env
from tests.integration.test_schemas import (
    assert_invalid,
    assert_valid,
    call,
    frames_of,
    infer_header,
    schemas,
)
from tests.integration.test_worker_death import POISONED_WORKER

pytestmark = pytest.mark.integration


def health_and_status(daemon: DaemonProcess) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``health`` and ``status`` replies, each valid against its schema."""
    health, _ = call(daemon.control, {"v": 1, "id": 1, "op": "health"})
    assert_valid("health_reply.json#/$defs/ok", health)
    status, _ = call(daemon.control, {"v": 1, "id": 2, "op": "status"})
    assert_valid("status_reply.json#/$defs/ok", status)
    return health["result"], status["result"]


def states(daemon: DaemonProcess) -> tuple[str, str]:
    """The daemon's state as ``health`` and ``status`` report it."""
    health, status = health_and_status(daemon)
    return health["state"], status["daemon"]["state"]


def test_the_daemon_state_follows_its_models_after_it_is_ready(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """No engine at start: ``demo`` serves on the fallback (degraded) while its engine
    is built; once the built engine is adopted every model serves on its configured
    runtime (serving); a failover while serving puts it back on the fallback
    (degraded again; one build allowed, so it stays there)."""
    marker = tmp_path / "executions-fail"
    daemon = daemon_factory(
        models=[{"name": "demo", "path": str(demo_model), "runtime": "tensorrt"}],
        runtime={"engine_dir": str(tmp_path / "engines"), "rebuild_max_attempts": 1},
        env=fake_gpu_env(
            {}, INFERD_FAKE_TRT_BUILD_STEP_S="0.15", INFERD_FAKE_TRT_FAIL_WHILE=str(marker)
        ),
    )
    with Events(daemon.events, topics=("runtime", "health")) as events:
        assert states(daemon) == ("degraded", "degraded")
        events.next(lambda t, p: t == "runtime" and p["runtime"] == "tensorrt", "the adoption")
        health, status = health_and_status(daemon)
        assert health["models"]["demo"] == {
            "state": "serving",
            "runtime": "tensorrt",
            "fallback": False,
            "queue_depth": 0,
        }
        assert (health["state"], status["daemon"]["state"]) == ("serving", "serving")
        published = events.next(lambda t, p: t == "health", "a health event")
        assert published["state"] == "serving"

        staged = marker.with_name("staged")
        staged.write_text(fake_tensorrt.ILLEGAL_ADDRESS)
        os.replace(staged, marker)  # executions fail from now on (sticky: at once)
        image = {"image": np.zeros((1, 3, 224, 224), np.float32)}
        reply, _ = call(daemon.infer, infer_header("demo", image), frames_of(image))
        assert reply["error"]["code"] == "INTERNAL", reply
        events.next(lambda t, p: t == "runtime" and p["fallback"], "the failover")
        assert states(daemon) == ("degraded", "degraded")
        published = events.next(lambda t, p: t == "health", "a health event")
        assert published["state"] == "degraded"


# -- alerts ---------------------------------------------------------------------------
@cache
def pinned_alert_codes() -> frozenset[str]:
    """The codes ``event_alert.json`` pins the level and fields of."""
    entries = schemas()["event_alert.json"]["oneOf"]
    return frozenset(
        entry["properties"]["code"]["const"]
        for entry in entries
        if "const" in entry["properties"]["code"]
    )


def assert_pinned_and_valid(alert: dict[str, Any]) -> None:
    """``alert`` (an ``alert`` event's payload) is valid and its code one the schema
    pins: "the codes the daemon raises today are pinned below"."""
    assert_valid("event_alert.json", alert)
    assert alert["code"] in pinned_alert_codes(), f"{alert['code']} is not pinned"


def test_an_engine_cache_the_daemon_cannot_have_raises_a_pinned_alert(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """``ort_cache_unavailable``: raised at every load of a TensorRT EP session without
    its cache dir (here a switch, once subscribed; the shortest rate limit, 1 s, sends
    it at once or, a repeat of the start's within the second, when the second ends)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("where the cache dir's parent should be")
    daemon = daemon_factory(
        runtime={"ort_trt_cache_dir": str(blocked / "cache")},
        alerts={"rate_limit_s": 1},
        env=fake_ort_env({}),
    )
    with Events(daemon.events, topics=("alert",)) as events:
        header = {"v": 1, "id": 3, "op": "runtime.switch", "model": "demo"}
        switched, _ = call(daemon.control, {**header, "runtime": "onnx_trt_ep"})
        assert_valid("switch_reply.json#/$defs/ok", switched)
        alert = events.next(lambda _t, p: p["code"] == "ort_cache_unavailable", "the alert")
    assert alert["fields"]["model"] == "demo"
    assert "runtime.ort_trt_cache_dir" in alert["fields"]["reason"]
    assert_pinned_and_valid(alert)


def test_a_dead_engine_worker_raises_a_pinned_alert(
    daemon_factory: DaemonFactory, demo_model: Path, tmp_path: Path
) -> None:
    """``engine_worker_died``, read back from the flight data recorder (the daemon
    exits right after it): the payload the ``pub`` hook publishes is the record's
    ``{level, code, message, fields}``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(POISONED_WORKER)
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    daemon = daemon_factory(
        models=[{"name": "poison", "path": str(demo_model)}],
        env={"PYTHONPATH": python_path, "INFERD_TEST_POISON_MODEL": "poison"},
    )
    image = {"image": np.zeros((1, 3, 224, 224), np.float32)}
    reply, _ = call(daemon.infer, infer_header("poison", image), frames_of(image))
    assert reply["error"]["code"] == "INTERNAL", reply
    assert daemon.process.wait(timeout=HANG_S) == 1
    (record,) = [r.payload for r in daemon.fdr_records("alert")]
    published = {key: record[key] for key in ("level", "code", "message", "fields")}
    assert published["code"] == "engine_worker_died"
    assert_pinned_and_valid({**published, "ts_ns": time.time_ns(), "seq": 1})


# -- build.start's arguments ------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_daemon(module_daemon_factory: DaemonFactory) -> DaemonProcess:
    return module_daemon_factory()


@pytest.mark.parametrize("fail", ["", "x" * 257, None], ids=["empty", "257 characters", "null"])
def test_the_control_schema_refuses_a_simulated_failure_the_daemon_refuses(
    demo_daemon: DaemonProcess, fail: str | None
) -> None:
    """``simulation.fail`` is the simulated builder's error: 1..256 characters (a null
    is not an absent knob: the daemon took it as one, the schema refused it; found
    by ``bench/fuzz.py --seed 20261207``)."""
    daemon = demo_daemon
    header = {
        "v": 1,
        "id": 5,
        "op": "build.start",
        "model": "demo",
        "builder": "simulated",
        "simulation": {"fail": fail},
    }
    reply, _ = call(daemon.control, header)
    assert_valid("build_start_reply.json", reply)
    assert reply["error"]["code"] == "INVALID_ARGUMENT", reply
    assert "'simulation.fail' must be a string of 1..256 characters" in reply["error"]["message"]
    assert_invalid("control_request.json", header)
    assert_valid("control_request.json", {**header, "simulation": {"fail": "x" * 256}})
