"""The JSON Schemas under ``schemas/bus/`` against what the real daemon sends and accepts.

Replies are received on raw DEALER sockets and decoded with plain
``msgpack.unpackb`` (no client library in between), events on an
``EventSubscriber``.  Integers are checked strictly: a msgpack float where the
schema says ``integer`` fails, even when its value is integral (jsonschema
alone would accept ``3.0``).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, get_args

import msgpack
import numpy as np
import pytest
import zmq
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from inferd.bus.publisher import TOPICS, EventPublisher
from inferd.config import QUEUE_POLICIES, RUNTIME_LABELS, ModelConfig, RuntimeConfig
from inferd.config.sections import MAX_DEADLINE_MS
from inferd.runtime.ort_providers import Degradation
from inferd.serving.rebuild_state import REBUILD_STATES
from inferd.serving.slot import ModelSlot, Sinks
from inferd.types import AlertLevel, ThermalState
from inferd_client import EventSubscriber, InferenceClient, OperatorClient, RequestTimeout
from inferd_wire import protocol, regions
from tests.conftest import (
    REPO,
    DaemonFactory,
    DaemonProcess,
    render_config,
    start_daemon,
    wait_until,
    write_slow_model,
)
from tests.integration.wire import queue_depth

pytestmark = pytest.mark.integration

SCHEMA_DIR = REPO / "schemas" / "bus"
BASE_URI = "https://inferd.example/schemas/bus/"
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_FILES = frozenset(
    {
        "common.json",
        "infer_request.json",
        "describe_request.json",
        "control_request.json",
        "infer_reply.json",
        "describe_reply.json",
        "status_reply.json",
        "health_reply.json",
        "error_reply.json",
        "event_health.json",
        "event_runtime.json",
        "event_alert.json",
        "event_thermal.json",
        "thermal_reply.json",
        "switch_reply.json",
        "event_build.json",
        "build_start_reply.json",
        "build_status_reply.json",
        "build_cancel_reply.json",
        "shm_request.json",
        "shm_reply.json",
    }
)
REPLY_TIMEOUT_S = 20.0
FALLBACK_ALERT = "fallback_to_onnx_trt_ep"


# -- schema loading ---------------------------------------------------------
def _is_strict_integer(_checker: Any, instance: object) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


StrictValidator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_strict_integer),
)


@cache
def schemas() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(SCHEMA_DIR.glob("*.json"))}


@cache
def registry() -> Registry:
    """Every file, registered under its $id.  "$schema" is dropped from the registered
    copies: jsonschema switches to the stock validator class for a subschema that
    names its metaschema, which would lose the strict integer check."""
    resources = []
    for schema in schemas().values():
        contents = {key: value for key, value in schema.items() if key != "$schema"}
        resources.append((schema["$id"], DRAFT202012.create_resource(contents)))
    return Registry().with_resources(resources)


@cache
def validator(ref: str) -> Any:
    """A validator for ``ref``: a file name, optionally with a ``#/$defs/...`` fragment."""
    return StrictValidator({"$ref": BASE_URI + ref}, registry=registry())


def schema_errors(ref: str, instance: object) -> list[str]:
    return [error.message for error in validator(ref).iter_errors(instance)]


def assert_valid(ref: str, instance: object) -> None:
    error = best_match(validator(ref).iter_errors(instance))
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path)
        raise AssertionError(f"{ref} rejects {instance!r}\n  at /{where}: {error.message}")


def assert_invalid(ref: str, instance: object) -> None:
    assert schema_errors(ref, instance), f"{ref} accepts {instance!r}"


def _refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


# -- raw bus helpers ----------------------------------------------------------
def exchange(
    endpoint: str, parts: list[bytes], timeout: float = REPLY_TIMEOUT_S
) -> tuple[dict[str, Any], list[bytes]]:
    """Send one multipart message on a fresh DEALER; returns (decoded header, frames)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(parts)
        assert sock.poll(int(timeout * 1000), zmq.POLLIN), f"no reply from {endpoint}"
        reply = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    header = msgpack.unpackb(reply[0], raw=False)
    assert isinstance(header, dict), header
    return header, reply[1:]


def call(
    endpoint: str, header: dict[str, Any], frames: list[bytes] | tuple[()] = ()
) -> tuple[dict[str, Any], list[bytes]]:
    return exchange(endpoint, [protocol.pack(header), *frames])


def infer_header(model: str, arrays: dict[str, np.ndarray], **extra: Any) -> dict[str, Any]:
    descriptors = [
        {"name": name, "dtype": array.dtype.name, "shape": list(array.shape)}
        for name, array in arrays.items()
    ]
    return {"v": 1, "id": 1, "op": "infer", "model": model, "inputs": descriptors, **extra}


def frames_of(arrays: dict[str, np.ndarray]) -> list[bytes]:
    return [np.ascontiguousarray(array).tobytes() for array in arrays.values()]


def assert_frames_match(descriptors: list[dict[str, Any]], frames: list[bytes]) -> None:
    """Each frame holds exactly prod(shape) * itemsize bytes of its descriptor."""
    assert len(descriptors) == len(frames)
    for descriptor, frame in zip(descriptors, frames, strict=True):
        itemsize = np.dtype(descriptor["dtype"]).itemsize
        assert len(frame) == math.prod(descriptor["shape"]) * itemsize, descriptor


def image(batch: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 224, 224), dtype=np.float32)


def receive_until(
    subscriber: EventSubscriber,
    predicate: Callable[[str, dict[str, Any]], bool],
    seen: list[tuple[str, dict[str, Any]]],
    timeout: float = REPLY_TIMEOUT_S,
) -> tuple[str, dict[str, Any]]:
    """Receive events (all kept in ``seen``) until one satisfies ``predicate``."""
    give_up_at = time.monotonic() + timeout
    while (remaining := give_up_at - time.monotonic()) > 0:
        event = subscriber.receive(timeout=remaining)
        if event is None:
            break
        seen.append(event)
        if predicate(*event):
            return event
    raise AssertionError(f"no matching event within {timeout}s; got topics {[t for t, _ in seen]}")


EVENT_SCHEMAS = {
    "health": "event_health.json",
    "runtime": "event_runtime.json",
    "alert": "event_alert.json",
    "thermal": "event_thermal.json",
    "build": "event_build.json",
}


def assert_events_valid(events: list[tuple[str, dict[str, Any]]]) -> None:
    for topic, payload in events:
        assert topic in EVENT_SCHEMAS, f"event on topic {topic!r} has no schema"
        assert_valid(EVENT_SCHEMAS[topic], payload)
    sequence = [payload["seq"] for _, payload in events]
    assert sequence == sorted(set(sequence)), sequence


# -- fixtures -----------------------------------------------------------------
def _served_models(demo_model: Path, identity_model: Path, missing: Path) -> list[dict[str, Any]]:
    """demo (fixed shapes), identity (dynamic batch) and a model that fails to load."""
    return [
        {"name": "demo", "path": str(demo_model)},
        {"name": "identity", "path": str(identity_model)},
        {"name": "broken", "path": str(missing)},
    ]


@pytest.fixture
def served(
    daemon_factory: DaemonFactory, demo_model: Path, identity_model: Path, tmp_path: Path
) -> DaemonProcess:
    return daemon_factory(models=_served_models(demo_model, identity_model, tmp_path / "x.onnx"))


@pytest.fixture(scope="module")
def served_for_module(
    module_daemon_factory: DaemonFactory,
    demo_model: Path,
    identity_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> DaemonProcess:
    """``served``, one for the module's one-request cases."""
    missing = tmp_path_factory.mktemp("served") / "x.onnx"
    return module_daemon_factory(models=_served_models(demo_model, identity_model, missing))


# -- (a) the schema files themselves ---------------------------------------------
def test_schema_directory_holds_exactly_the_known_files() -> None:
    assert set(schemas()) == SCHEMA_FILES
    assert (SCHEMA_DIR / "README.md").is_file()


@pytest.mark.parametrize("name", sorted(SCHEMA_FILES))
def test_schema_is_valid_and_its_refs_resolve(name: str) -> None:
    schema = schemas()[name]
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == DRAFT_2020_12
    assert schema["$id"] == BASE_URI + name
    assert isinstance(schema.get("title"), str) and schema["title"]
    assert isinstance(schema.get("description"), str) and schema["description"]
    # The files as published, each registered under its $id (its dialect read from "$schema").
    published = Registry().with_resources(
        (s["$id"], Resource.from_contents(s)) for s in schemas().values()
    )
    resolver = published.resolver(base_uri=schema["$id"])
    refs = list(_refs(schema))
    for ref in refs:
        resolver.lookup(ref)  # raises referencing.exceptions.Unresolvable
    if name != "common.json":
        assert refs, f"{name} shares nothing with common.json"


def test_schema_vocabularies_match_the_code() -> None:
    defs = schemas()["common.json"]["$defs"]
    assert set(defs["dtype"]["enum"]) == protocol.ALLOWED_DTYPES
    assert set(defs["error_code"]["enum"]) == {str(code) for code in protocol.Code}
    assert tuple(defs["runtime_label"]["enum"]) == RUNTIME_LABELS
    assert tuple(defs["queue_policy"]["enum"]) == QUEUE_POLICIES
    assert tuple(defs["alert_level"]["enum"]) == get_args(AlertLevel)
    assert tuple(defs["provider_degradation"]["enum"]) == get_args(Degradation)
    assert defs["protocol_version"]["const"] == protocol.PROTOCOL_VERSION
    assert defs["request_id"]["oneOf"][1]["maxLength"] == protocol.MAX_ID_CHARS
    assert defs["request_id"]["oneOf"][0]["maximum"] == 2**64 - 1
    deadline = schemas()["infer_request.json"]["properties"]["deadline_ms"]
    assert deadline["maximum"] == MAX_DEADLINE_MS
    region = defs["region_tensor_descriptor"]["properties"]
    assert region["offset"]["multipleOf"] == regions.REGION_ALIGNMENT
    assert defs["region_id"]["pattern"] == f"^[0-9a-f]{{{regions.REGION_ID_HEX}}}$"
    rebuilds = schemas()["status_reply.json"]["$defs"]["builds"]["properties"]["rebuilds"]
    assert (
        tuple(
            rebuilds["properties"]["models"]["additionalProperties"]["properties"]["state"]["enum"]
        )
        == REBUILD_STATES
    )
    ops = [entry["properties"]["op"]["const"] for entry in schemas()["shm_request.json"]["oneOf"]]
    assert tuple(ops) == (*regions.SHM_OPS, "infer")  # registration ops, then requests
    assert {name.removeprefix("event_") for name in EVENT_SCHEMAS.values()} <= {
        f"{topic}.json" for topic in TOPICS
    }


# -- (b) what the Python client sends ---------------------------------------------
def test_client_request_headers_match_the_request_schemas() -> None:
    """Capture the messages InferenceClient/OperatorClient really send on a ROUTER."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://schema-capture")
    inference = InferenceClient("inproc://schema-capture", timeout=0.05, context=context)
    operator = OperatorClient("inproc://schema-capture", timeout=0.05, context=context)

    def sent(do: Callable[[], object]) -> tuple[dict[str, Any], list[bytes]]:
        with pytest.raises(RequestTimeout):
            do()
        assert router.poll(1000, zmq.POLLIN)
        _identity, header, *frames = router.recv_multipart()
        return msgpack.unpackb(header, raw=False), frames

    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]  # not C-contiguous
    try:
        header, frames = sent(lambda: inference.infer("demo", {"image": image()}))
        assert_valid("infer_request.json", header)
        assert "deadline_ms" not in header
        assert_frames_match(header["inputs"], frames)

        inputs = {
            "a": big_endian,
            "b": strided,
            "c": np.zeros((0, 2), np.uint8),
            "d": np.array(True),
        }
        header, frames = sent(lambda: inference.infer("m", inputs, deadline_ms=250))
        assert_valid("infer_request.json", header)
        assert header["deadline_ms"] == 250
        assert_frames_match(header["inputs"], frames)
        assert frames[0] == big_endian.astype("<i4").tobytes()  # little-endian on the wire
        assert frames[1] == np.ascontiguousarray(strided).tobytes()

        header, frames = sent(inference.describe)
        assert_valid("describe_request.json", header)
        assert frames == []
        for op in (operator.status, operator.health):
            header, frames = sent(op)
            assert_valid("control_request.json", header)
            assert frames == []
    finally:
        inference.close()
        operator.close()
        router.close(linger=0)
        context.term()


# -- what the daemon accepts and refuses --------------------------------------------
ACCEPTED = {
    "id zero": {"id": 0},
    "id max uint64": {"id": 2**64 - 1},
    "id one-char string": {"id": "x"},
    "id 128 non-ASCII chars": {"id": "é" * 128},
    "deadline max": {"deadline_ms": MAX_DEADLINE_MS},
    "deadline fractional": {"deadline_ms": 2500.5},
}


@pytest.mark.parametrize("change", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_daemon_serves_edge_cases_the_schema_accepts(
    served_for_module: DaemonProcess, change: dict
) -> None:
    arrays = {"input": image(batch=2)}
    header = {**infer_header("identity", arrays), **change}
    assert_valid("infer_request.json", header)
    reply, frames = call(served_for_module.infer, header, frames_of(arrays))
    assert_valid("infer_reply.json#/$defs/ok", reply)
    assert reply["id"] == header["id"]
    assert_frames_match(reply["outputs"], frames)


def test_zero_sized_tensors_round_trip(served: DaemonProcess) -> None:
    arrays = {"input": np.zeros((0, 3, 224, 224), np.float32)}
    header = infer_header("identity", arrays)
    assert_valid("infer_request.json", header)
    reply, frames = call(served.infer, header, frames_of(arrays))
    assert_valid("infer_reply.json#/$defs/ok", reply)
    assert reply["outputs"][0]["shape"] == [0, 3, 224, 224]
    assert frames == [b""]


def _descriptor(**change: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "image", "dtype": "float32", "shape": [1, 3, 224, 224], **change}]}


# change to a valid demo request -> whether the daemon echoes the id (True), answers
# with a null id (False), or may do either (None: a wrong "v" with a good id; the
# daemon now echoes it, earlier versions answered null; the schema allows both).
REFUSED: dict[str, tuple[dict[str, Any], bool | None]] = {
    "id bool": ({"id": True}, False),
    "id negative": ({"id": -1}, False),
    "id empty string": ({"id": ""}, False),
    "id 129 chars": ({"id": "x" * 129}, False),
    "id float": ({"id": 1.0}, False),
    "v 2": ({"v": 2}, None),
    "v true": ({"v": True}, None),
    "op not a string": ({"op": 5}, True),
    "model not a string": ({"model": 5}, True),
    "inputs missing": ({"inputs": None}, True),
    "deadline zero": ({"deadline_ms": 0}, True),
    "deadline negative": ({"deadline_ms": -5}, True),
    "deadline over max": ({"deadline_ms": MAX_DEADLINE_MS + 1}, True),
    "deadline string": ({"deadline_ms": "10"}, True),
    "deadline bool": ({"deadline_ms": True}, True),
    "dtype complex": (_descriptor(dtype="complex64"), True),
    "dtype big-endian": (_descriptor(dtype=">f4"), True),
    "shape float dim": (_descriptor(shape=[1.0, 3, 224, 224]), True),
    "shape negative dim": (_descriptor(shape=[-1, 3, 224, 224]), True),
    "shape 17 dims": (_descriptor(shape=[1] * 17), True),
    "name empty": (_descriptor(name=""), True),
}


@pytest.mark.parametrize("change, id_known", REFUSED.values(), ids=REFUSED.keys())
def test_daemon_refuses_what_the_schema_refuses(
    served_for_module: DaemonProcess, change: dict[str, Any], id_known: bool | None
) -> None:
    arrays = {"image": image()}
    header = {**infer_header("demo", arrays), **change}
    header = {key: value for key, value in header.items() if value is not None}  # None: drop
    assert_invalid("infer_request.json", header)
    reply, frames = call(served_for_module.infer, header, frames_of(arrays))
    assert_valid("infer_reply.json", reply)
    assert_valid("error_reply.json", reply)
    assert reply["error"]["code"] == "INVALID_ARGUMENT"
    expected_ids = {True: [header["id"]], False: [None], None: [header["id"], None]}[id_known]
    assert reply["id"] in expected_ids
    assert frames == []


# -- (c) replies of the real daemon ----------------------------------------------------
def test_infer_replies(served: DaemonProcess) -> None:
    arrays = {"image": image()}
    reply, frames = call(served.infer, infer_header("demo", arrays, id=41), frames_of(arrays))
    assert_valid("infer_reply.json", reply)
    assert_valid("infer_reply.json#/$defs/ok", reply)
    assert reply["id"] == 41 and reply["runtime"] == "onnx_trt_ep" and reply["fallback"] is False
    assert_frames_match(reply["outputs"], frames)

    good = frames_of(arrays)
    short = frames_of({"image": np.zeros((1, 3, 224, 223), np.float32)})
    complex_dtype = {**infer_header("demo", arrays, id=8), **_descriptor(dtype="complex64")}
    wrong_dtype = {**infer_header("demo", arrays, id=9), **_descriptor(dtype="float64")}
    invalid = "INVALID_ARGUMENT"
    # case -> (message parts, expected code, expected id)
    errors: dict[str, tuple[list[bytes], str, object]] = {
        "unknown model": (
            [protocol.pack(infer_header("nope", arrays, id="req-1")), *good],
            "NOT_FOUND",
            "req-1",
        ),
        "model failed to load": (
            [protocol.pack(infer_header("broken", arrays, id=7)), *good],
            "UNAVAILABLE",
            7,
        ),
        "dtype not allowed": ([protocol.pack(complex_dtype), *good], invalid, 8),
        "dtype differs from the model": ([protocol.pack(wrong_dtype), *good], invalid, 9),
        "frame byte length wrong": (
            [protocol.pack(infer_header("demo", arrays, id=10)), *short],
            invalid,
            10,
        ),
        "frame missing": ([protocol.pack(infer_header("demo", arrays, id=11))], invalid, 11),
        "unknown op": ([protocol.pack({"v": 1, "id": 12, "op": "status"})], invalid, 12),
        "garbage header": ([b"\xc1\xff garbage"], invalid, None),
        "header not a map": ([protocol.pack([1, 2, 3])], invalid, None),
        "header without id": ([protocol.pack({"v": 1, "op": "describe"})], invalid, None),
    }
    for case, (parts, code, request_id) in errors.items():
        reply, frames = exchange(served.infer, parts)
        assert_valid("infer_reply.json", reply)
        assert_valid("error_reply.json", reply)
        assert (reply["error"]["code"], reply["id"], frames) == (code, request_id, []), case


def test_queue_error_replies(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED and CANCELLED from a busy daemon."""
    # ~6x the default model's tens of milliseconds: 3 stays queued long enough to be seen.
    slow = write_slow_model(tmp_path / "slow.onnx", matmuls=36)
    daemon = daemon_factory(
        models=[
            {"name": "slow", "path": str(slow), "queue_capacity": 2},
            {"name": "latest", "path": str(slow), "queue_capacity": 4, "queue_policy": "latest"},
        ]
    )
    arrays = {"x": np.ones((512, 512), np.float32)}
    payload = frames_of(arrays)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.infer)
    # 1 runs and 3 waits behind it before 2 (deadline 1 ms) is sent: 2 then waits at
    # least one run, however late a loaded machine delivers it.
    first = [infer_header("slow", arrays, id=1), infer_header("slow", arrays, id=3)]
    rest = [infer_header("slow", arrays, id=2, deadline_ms=1)]
    rest += [infer_header("slow", arrays, id=i) for i in range(4, 9)]
    rest += [infer_header("latest", arrays, id=i) for i in range(9, 12)]
    sent = first + rest
    replies: dict[int, dict[str, Any]] = {}
    try:
        for header in sent:
            assert_valid("infer_request.json", header)
        for header in first:
            sock.send_multipart([protocol.pack(header), *payload])
        wait_until(lambda: queue_depth(daemon.control, "slow") >= 1, 10, message="3 queued")
        for header in rest:
            sock.send_multipart([protocol.pack(header), *payload])
        while len(replies) < len(sent):
            assert sock.poll(int(REPLY_TIMEOUT_S * 1000), zmq.POLLIN), sorted(replies)
            header_frame, *frames = sock.recv_multipart()
            reply = msgpack.unpackb(header_frame, raw=False)
            assert_valid("infer_reply.json", reply)
            if reply["ok"]:
                assert_frames_match(reply["outputs"], frames)
            replies[reply["id"]] = reply
    finally:
        sock.close(linger=0)
    codes = {reply["error"]["code"] for reply in replies.values() if not reply["ok"]}
    assert replies[2]["error"]["code"] == "DEADLINE_EXCEEDED"
    assert {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED"} <= codes

    status, _ = call(daemon.control, {"v": 1, "id": 99, "op": "status"})
    assert_valid("status_reply.json#/$defs/ok", status)
    responses = {m["model"]: m["responses"] for m in status["result"]["models"]}
    assert {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"} <= set(responses["slow"])
    assert "CANCELLED" in responses["latest"]


def test_describe_reply(served: DaemonProcess) -> None:
    header = {"v": 1, "id": "describe-1", "op": "describe"}
    assert_valid("describe_request.json", header)
    reply, frames = call(served.infer, header)
    assert_valid("describe_reply.json", reply)
    assert_valid("describe_reply.json#/$defs/ok", reply)
    assert frames == []
    models = {model["name"]: model for model in reply["result"]["models"]}
    assert models["identity"]["inputs"][0]["shape"] == [None, 3, 224, 224]
    assert models["broken"] == {"name": "broken", "state": "failed", "inputs": [], "outputs": []}


def test_control_replies(served: DaemonProcess) -> None:
    with InferenceClient(served.infer) as client:
        client.infer("demo", {"image": image()})
    unknown, _ = call(served.infer, infer_header("nope", {"image": image()}))
    assert unknown["error"]["code"] == "NOT_FOUND"

    header = {"v": 1, "id": 2**63, "op": "status"}
    assert_valid("control_request.json", header)
    status, frames = call(served.control, header)
    assert_valid("status_reply.json", status)
    assert_valid("status_reply.json#/$defs/ok", status)
    assert frames == [] and status["id"] == 2**63
    models = {model["model"]: model for model in status["result"]["models"]}
    # Both branches of latency_us: a model with results and one without.
    assert models["demo"]["latency_us"]["window"] == 1 and "p99" in models["demo"]["latency_us"]
    assert models["broken"]["latency_us"] == {"window": 0}
    assert models["broken"]["runtime"] is None and models["broken"]["reason"]
    assert status["result"]["daemon"]["state"] == "degraded"

    header = {"v": 1, "id": "h", "op": "health"}
    assert_valid("control_request.json", header)
    health, frames = call(served.control, header)
    assert_valid("health_reply.json", health)
    assert_valid("health_reply.json#/$defs/ok", health)
    assert frames == []
    assert health["result"]["models"]["broken"]["runtime"] is None

    header = {"v": 1, "id": "t", "op": "thermal"}
    assert_valid("control_request.json", header)
    thermal, frames = call(served.control, header)
    assert_valid("thermal_reply.json", thermal)
    assert_valid("thermal_reply.json#/$defs/ok", thermal)
    assert frames == [] and thermal["result"]["running"] is True
    assert status["result"]["fdr"]["enabled"] is True

    refused, frames = call(served.control, {"v": 1, "id": 5, "op": "describe"})
    assert_valid("status_reply.json", refused)
    assert_valid("error_reply.json", refused)
    assert (refused["id"], refused["error"]["code"], frames) == (5, "INVALID_ARGUMENT", [])


# -- (d) events ------------------------------------------------------------------------
def test_health_and_fallback_alert_events(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    """runtime='tensorrt' cannot load here: the model fails over to onnx_trt_ep and the
    first inference raises the fallback_to_onnx_trt_ep alert."""
    daemon = daemon_factory(
        models=[{"name": "trt", "path": str(identity_model), "runtime": "tensorrt"}]
    )
    seen: list[tuple[str, dict[str, Any]]] = []
    with EventSubscriber(daemon.events) as events:
        # A health event proves the subscription is live before the alert can fire.
        receive_until(events, lambda topic, _: topic == "health", seen)
        with InferenceClient(daemon.infer) as client:
            client.infer("trt", {"input": image()})
            reply = client.last_reply
        _, alert = receive_until(
            events, lambda topic, p: topic == "alert" and p["code"] == FALLBACK_ALERT, seen
        )
        receive_until(events, lambda topic, _: topic == "health", seen)
    assert_valid("infer_reply.json#/$defs/ok", reply)
    assert (reply["runtime"], reply["fallback"]) == ("onnx_trt_ep", True)
    assert_events_valid(seen)
    assert alert["level"] == "WARNING"
    health = [payload for topic, payload in seen if topic == "health"]
    assert health[-1]["models"]["trt"] == {
        "state": "serving",
        "runtime": "onnx_trt_ep",
        "fallback": True,
        "queue_depth": 0,
    }


def test_startup_runtime_and_alert_events_of_the_daemon(
    identity_model: Path, tmp_path: Path
) -> None:
    """Subscribe before the daemon starts to catch what it publishes while activating.

    PUB/SUB joins asynchronously, so the SUB socket may still miss these events
    (they are published once, tens of ms after the PUB socket binds).  Whatever
    arrives is validated; ``test_runtime_event_published_in_process`` covers the
    runtime payload deterministically.
    """
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))  # short: ipc paths max 107 bytes
    models = [
        {"name": "trt", "path": str(identity_model), "runtime": "tensorrt"},
        {"name": "broken", "path": str(tmp_path / "missing.onnx")},
    ]
    context = zmq.Context()
    context.setsockopt(zmq.RECONNECT_IVL, 2)  # retry the not-yet-bound ipc path every 2 ms
    subscriber = EventSubscriber(f"ipc://{workdir}/run/events.sock", context=context)
    daemon: DaemonProcess | None = None
    try:
        daemon = start_daemon(render_config(workdir, models), workdir)
        seen: list[tuple[str, dict[str, Any]]] = []
        receive_until(subscriber, lambda topic, p: topic == "health" and p["seq"] > 4, seen)
    finally:
        subscriber.close()
        context.term()
        if daemon is not None:
            daemon.stop(signal.SIGTERM)
        shutil.rmtree(workdir, ignore_errors=True)
    assert_events_valid(seen)
    runtime = {p["model"]: p for topic, p in seen if topic == "runtime"}
    if "trt" in runtime:
        assert runtime["trt"]["fallback"] is True and runtime["trt"]["state"] == "serving"
    if "broken" in runtime:
        assert runtime["broken"]["state"] == "failed" and runtime["broken"]["runtime"] is None
    for _, alert in (event for event in seen if event[0] == "alert"):
        assert alert["code"] == "model_unavailable"
        assert alert["fields"] == {"model": "broken"}


def test_runtime_event_published_in_process(identity_model: Path, tmp_path: Path) -> None:
    """The daemon publishes 'runtime' events only at startup, before any subscriber of a
    started daemon can be connected; so drive the same code in process: a ModelSlot
    activating (tensorrt -> onnx_trt_ep failover, and a model that fails) publishes
    through a real EventPublisher, received on a SUB socket."""
    context = zmq.Context()
    publisher = EventPublisher(
        context, "inproc://schema-events", health=dict, health_interval_s=0.02
    )
    publisher.start()
    publisher.wait_bound(timeout=10)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://schema-events")
    runtime_config = RuntimeConfig(ort_intra_op_threads=1, ort_trt_cache_dir=tmp_path / "cache")
    slots = [
        ModelSlot(ModelConfig(name="trt", path=identity_model, runtime="tensorrt")),
        ModelSlot(ModelConfig(name="broken", path=tmp_path / "missing.onnx")),
    ]
    received: dict[str, dict[str, Any]] = {}
    try:
        assert sub.poll(10_000, zmq.POLLIN)  # a (stub) health event: the subscription is live
        for slot in slots:
            slot.activate(
                runtime_config,
                Sinks(
                    alert=lambda _alert: None,
                    events=publisher.publish,
                    record=lambda _kind, _payload: None,
                    thermal=ThermalState.unavailable,
                ),
            )
        give_up_at = time.monotonic() + REPLY_TIMEOUT_S
        while len(received) < len(slots) and time.monotonic() < give_up_at:
            if not sub.poll(1000, zmq.POLLIN):
                continue
            topic, payload = sub.recv_multipart()
            if topic == b"runtime":
                event = msgpack.unpackb(payload, raw=False)
                received[event["model"]] = event
    finally:
        for slot in slots:
            slot.release()
        publisher.stop()
        publisher.join(timeout=10)
        sub.close(linger=0)
        context.term()
    assert set(received) == {"trt", "broken"}
    for event in received.values():
        assert_valid("event_runtime.json", event)
    assert received["trt"]["fallback"] is True and received["trt"]["runtime"] == "onnx_trt_ep"
    assert received["broken"]["state"] == "failed" and received["broken"]["runtime"] is None


# -- (e) the schemas are strict ------------------------------------------------------------
def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    *parents, last = path.split(".")

    def mutate(message: dict[str, Any]) -> None:
        node: Any = message
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    *parents, last = path.split(".")

    def mutate(message: dict[str, Any]) -> None:
        node: Any = message
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[last]

    return mutate


MUTATIONS: list[tuple[str, str, Callable[[dict[str, Any]], None]]] = [
    ("infer_ok", "extra top-level field", _set("extra", 1)),
    ("infer_ok", "latency_us as a string", _set("latency_us", "12")),
    ("infer_ok", "latency_us as a float", _set("latency_us", 12.0)),
    ("infer_ok", "queue_us missing", _delete("queue_us")),
    ("infer_ok", "id null on success", _set("id", None)),
    ("infer_ok", "fallback as an int", _set("fallback", 0)),
    ("infer_ok", "late missing", _delete("late")),
    ("infer_ok", "late as an int", _set("late", 1)),
    ("infer_ok", "unknown runtime", _set("runtime", "cuda")),
    ("infer_ok", "extra descriptor field", _set("outputs.0.strides", [4])),
    ("infer_ok", "output dtype not allowed", _set("outputs.0.dtype", "complex64")),
    ("infer_ok", "output dynamic dim", _set("outputs.0.shape.0", None)),
    ("infer_error", "unknown error code", _set("error.code", "BOGUS")),
    ("infer_error", "extra error field", _set("error.details", "x")),
    ("infer_error", "outputs on an error", _set("outputs", [])),
    ("infer_error", "ok true with an error", _set("ok", True)),
    ("describe", "extra model field", _set("result.models.0.runtime", "onnx_trt_ep")),
    ("describe", "negative dim", _set("result.models.0.inputs.0.shape.0", -1)),
    ("status", "extra models field", _set("result.models.0.extra", 1)),
    ("status", "p99 missing with results", _delete("result.models.0.latency_us.p99")),
    ("status", "unknown response code", _set("result.models.0.responses.MAYBE", 1)),
    ("status", "pid as a string", _set("result.daemon.pid", "12")),
    ("status", "extra bus counter", _set("result.bus.extra", 0)),
    ("health", "unknown thread", _set("result.threads.extra", True)),
    ("health", "unknown model state", _set("result.models.demo.state", "busy")),
    ("health", "uptime as a string", _set("result.uptime_s", "1.5")),
    ("health_event", "seq missing", _delete("seq")),
    ("health_event", "extra field", _set("extra", 1)),
    ("alert_event", "fallback alert without model_sha256", _delete("fields.model_sha256")),
    ("alert_event", "unknown level", _set("level", "LOUD")),
    ("infer_request", "extra field", _set("priority", 1)),
    ("infer_request", "big-endian dtype", _set("inputs.0.dtype", ">f4")),
]
SAMPLE_SCHEMAS = {
    "infer_ok": "infer_reply.json",
    "infer_error": "infer_reply.json",
    "describe": "describe_reply.json",
    "status": "status_reply.json",
    "health": "health_reply.json",
    "health_event": "event_health.json",
    "alert_event": "event_alert.json",
    "infer_request": "infer_request.json",
}


def test_schemas_refuse_drifted_messages(daemon_factory: DaemonFactory, demo_model: Path) -> None:
    """Real messages pass; each one-field drift of them fails."""
    daemon = daemon_factory(
        models=[
            {"name": "demo", "path": str(demo_model)},
            {"name": "trt", "path": str(demo_model), "runtime": "tensorrt"},
        ]
    )
    arrays = {"image": image()}
    request = infer_header("demo", arrays)
    seen: list[tuple[str, dict[str, Any]]] = []
    with EventSubscriber(daemon.events) as events:
        receive_until(events, lambda topic, _: topic == "health", seen)
        infer_ok, _ = call(daemon.infer, request, frames_of(arrays))
        call(daemon.infer, infer_header("trt", arrays), frames_of(arrays))
        _, alert = receive_until(
            events, lambda topic, p: topic == "alert" and p["code"] == FALLBACK_ALERT, seen
        )
    samples = {
        "infer_ok": infer_ok,
        "infer_error": call(daemon.infer, infer_header("nope", arrays), frames_of(arrays))[0],
        "describe": call(daemon.infer, {"v": 1, "id": 1, "op": "describe"})[0],
        "status": call(daemon.control, {"v": 1, "id": 1, "op": "status"})[0],
        "health": call(daemon.control, {"v": 1, "id": 1, "op": "health"})[0],
        "health_event": next(payload for topic, payload in seen if topic == "health"),
        "alert_event": alert,
        "infer_request": request,
    }
    for kind, sample in samples.items():
        assert_valid(SAMPLE_SCHEMAS[kind], sample)
    still_valid = []
    for kind, description, mutate in MUTATIONS:
        drifted = copy.deepcopy(samples[kind])
        mutate(drifted)
        if not schema_errors(SAMPLE_SCHEMAS[kind], drifted):
            still_valid.append(f"{kind}: {description}")
    assert still_valid == []
