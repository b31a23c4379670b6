"""Golden vectors of the wire protocol, for every client (schemas/conformance/README.md).

Writes one file per message part (``<name>.<part>.bin``: the header or payload
frame, then each tensor frame) and ``manifest.json``, which says for each
vector what it is and what a client must make of it:

* ``infer_request`` / ``describe_request`` / ``control_request``: ``request`` holds the
  arguments; a client encoding them must produce the files byte for byte. The
  bytes are made here by the Python client's own encoder
  (``inferd_client.prepared.PreparedHeader``).
* ``infer_reply``, ``control_reply`` (with the ``op``) and ``event`` (with the ``topic``):
  a client decoding the files must produce ``expected`` (the canonical form
  below), or refuse them as malformed when ``expected`` is ``{"malformed": true}``.

Canonical forms: an infer reply is its header, with each output descriptor of
a frame given the frame's bytes as ``data_hex``; an error reply is its header;
a control reply is its ``result``; an event is its payload.

Run ``python schemas/conformance/generate.py`` after changing the protocol;
tests/unit/client/test_conformance.py checks that the committed files are what
this script writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from inferd_client.client import infer_request_header
from inferd_client.prepared import PreparedHeader
from inferd_client.region import SharedRegion
from inferd_client.shm import encode_inputs, placed_outputs
from inferd_wire import protocol

HERE = Path(__file__).resolve().parent
REGION_ID = "0123456789abcdef0123456789abcdef"
OTHER_REGION_ID = "fedcba9876543210fedcba9876543210"
MALFORMED = {"malformed": True}


def pack(value: object) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


class Vectors:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.files: dict[str, bytes] = {}

    def add(self, name: str, kind: str, parts: list[bytes], **fields: Any) -> None:
        names = [f"{name}.{index}.bin" for index in range(len(parts))]
        self.files.update(zip(names, parts, strict=True))
        self.entries.append({"name": name, "kind": kind, "files": names, **fields})


def tensor_json(descriptor: dict[str, Any]) -> dict[str, Any]:
    return {key: descriptor[key] for key in descriptor}


# -- requests: encoded by the Python client -------------------------------------------
def requests(vectors: Vectors) -> None:
    image = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) / 7
    mask = np.array([[True, False], [False, True]])
    counts = np.arange(5, dtype=np.int64) - 2
    half = np.linspace(-1, 1, 6, dtype=np.float16).reshape(3, 2)
    small = np.array([250, 3], dtype=np.uint8)
    # (name, model, inputs, deadline_ms, id, max_reply_frame_bytes)
    cases: list[tuple[str, str, dict[str, np.ndarray], int | None, int, int | None]] = [
        ("infer_request_one_input", "demo", {"image": image}, None, 1, None),
        (
            "infer_request_many_dtypes",
            "multi",
            {"mask": mask, "counts": counts, "half": half, "small": small},
            None,
            (1 << 40) + 77,
            None,
        ),
        ("infer_request_deadline", "demo", {"image": image}, 50, 2**64 - 1, None),
        ("infer_request_big_deadline", "demo", {"image": image[:1]}, 3_600_000, 65536, None),
        ("infer_request_reply_bound", "demo", {"image": image}, 50, 3, 2**63 - 1),
        ("infer_request_small_reply_bound", "demo", {"image": image}, None, 4, 4096),
        (
            "infer_request_scalar_and_empty",
            "odd",
            {"scalar": np.array(3.5, np.float64), "empty": np.zeros((0, 4), np.int32)},
            1,
            127,
            None,
        ),
    ]
    for name, model, inputs, deadline_ms, request_id, bound in cases:
        descriptors, frames = encode_inputs(dict(inputs), {})
        header = infer_request_header(model, descriptors, [], deadline_ms, bound)
        request = {
            "id": request_id,
            "model": model,
            "inputs": [tensor_json(d) for d in descriptors],
            "outputs": [],
            "deadline_ms": deadline_ms,
            "max_reply_frame_bytes": bound,
        }
        parts = [PreparedHeader(header).encode(request_id), *(bytes(f.data) for f in frames)]
        vectors.add(name, "infer_request", parts, request=request)

    # Region inputs and placed outputs: the descriptors carry region, offset, nbytes.
    with SharedRegion(8192) as region:
        regions = {REGION_ID: region}
        placed_input = region.array((2, 3, 4), np.float32)
        placed_input[...] = image
        output = region.array((4, 2), np.float32)
        framed = np.arange(3, dtype=np.int16)
        descriptors, frames = encode_inputs({"image": placed_input, "bias": framed}, regions)
        placed = placed_outputs({"descriptors": output}, regions)
        header = infer_request_header("demo", descriptors, placed, 20)
        request = {
            "id": 9,
            "model": "demo",
            "inputs": [tensor_json(d) for d in descriptors],
            "outputs": [tensor_json(d) for d in placed],
            "deadline_ms": 20,
            "max_reply_frame_bytes": None,
        }
        parts = [PreparedHeader(header).encode(9), *(bytes(f.data) for f in frames)]
        vectors.add("infer_request_regions", "infer_request", parts, request=request)
        del placed_input, output

    header = {"v": protocol.PROTOCOL_VERSION, "op": "describe"}
    vectors.add(
        "describe_request",
        "describe_request",
        [PreparedHeader(header).encode(5)],
        request={"id": 5},
    )
    for name, op, arguments, request_id in (
        ("control_request_status", "status", {}, 300),
        (
            "control_request_switch",
            "runtime.switch",
            {"model": "demo", "runtime": "onnx_trt_ep", "requested_by": "flight-sw"},
            70000,
        ),
    ):
        header = {"v": protocol.PROTOCOL_VERSION, "op": op, **arguments}
        vectors.add(
            name,
            "control_request",
            [PreparedHeader(header).encode(request_id)],
            request={"id": request_id, "op": op, "arguments": arguments},
        )


# -- replies and events: what the daemon sends ---------------------------------------
def ok_infer(request_id: object, outputs: list[dict[str, Any]], **changes: Any) -> dict[str, Any]:
    header = protocol.ok_header(
        request_id,
        model="demo",
        runtime="onnx_trt_ep",
        fallback=False,
        latency_us=8123,
        queue_us=45,
        late=False,
        thermal="nominal",
        outputs=outputs,
    )
    header.update(changes)
    return header


def canonical_infer(header: dict[str, Any], frames: list[bytes]) -> dict[str, Any]:
    expected = dict(header)
    remaining = iter(frames)
    expected["outputs"] = [
        d if "region" in d else {**d, "data_hex": next(remaining).hex()} for d in header["outputs"]
    ]
    return expected


def replies(vectors: Vectors) -> None:
    output = np.arange(6, dtype=np.float32).reshape(1, 2, 3) - 2.5
    flags = np.array([True, False, True])
    d_out = {"name": "descriptors", "dtype": "float32", "shape": [1, 2, 3]}
    d_flags = {"name": "flags", "dtype": "bool", "shape": [3]}
    two_frames = [output.tobytes(), flags.tobytes()]

    def infer_ok(
        name: str, header: dict[str, Any], frames: list[bytes], asked: list[Any] | None = None
    ) -> None:
        vectors.add(
            name,
            "infer_reply",
            [pack(header), *frames],
            asked=asked or [],
            expected=canonical_infer(header, frames),
        )

    infer_ok("infer_reply_ok", ok_infer(17, [d_out, d_flags]), two_frames)
    infer_ok(
        "infer_reply_late",
        ok_infer(
            2**64 - 1, [d_out], late=True, thermal="throttling", runtime="tensorrt", fallback=True
        ),
        two_frames[:1],
    )
    infer_ok("infer_reply_string_id", ok_infer("req-1", [d_out], thermal="unknown"), two_frames[:1])
    placed = {**d_out, "region": REGION_ID, "offset": 256, "nbytes": 24}
    infer_ok("infer_reply_placed_output", ok_infer(9, [placed, d_flags]), two_frames[1:], [placed])
    for code in protocol.Code:
        header = protocol.error_header(40, code, f"why {code} was answered")
        vectors.add(
            f"infer_reply_error_{code.lower()}",
            "infer_reply",
            [pack(header)],
            asked=[],
            expected=header,
        )
    header = protocol.error_header(None, protocol.Code.INVALID_ARGUMENT, "header is not msgpack")
    vectors.add(
        "infer_reply_error_null_id", "infer_reply", [pack(header)], asked=[], expected=header
    )

    def infer_bad(name: str, parts: list[bytes], why: str, asked: list[Any] | None = None) -> None:
        asked = asked or []
        vectors.add(name, "infer_reply", parts, asked=asked, expected=MALFORMED, why=why)

    good = ok_infer(17, [d_out])
    infer_bad("infer_reply_not_msgpack", [b"\xc1"], "0xc1 is never used in msgpack")
    infer_bad(
        "infer_reply_trailing_bytes",
        [pack(good) + b"\x00", two_frames[0]],
        "bytes after the header's map",
    )
    infer_bad("infer_reply_not_a_map", [pack([1, 2])], "a header is a map")
    infer_bad(
        "infer_reply_version_2", [pack({**good, "v": 2}), two_frames[0]], "this client speaks v=1"
    )
    infer_bad(
        "infer_reply_bool_id", [pack({**good, "id": True}), two_frames[0]], "booleans are not ids"
    )
    missing_late = {key: value for key, value in good.items() if key != "late"}
    infer_bad(
        "infer_reply_without_late",
        [pack(missing_late), two_frames[0]],
        "late is required in every ok reply",
    )
    infer_bad(
        "infer_reply_unknown_key",
        [pack({**good, "priority": 1}), two_frames[0]],
        "a key the protocol does not have",
    )
    infer_bad(
        "infer_reply_late_not_bool", [pack({**good, "late": 1}), two_frames[0]], "late is a boolean"
    )
    infer_bad(
        "infer_reply_unknown_runtime",
        [pack({**good, "runtime": "tvm"}), two_frames[0]],
        "runtime is tensorrt or onnx_trt_ep",
    )
    infer_bad(
        "infer_reply_unknown_thermal",
        [pack({**good, "thermal": "hot"}), two_frames[0]],
        "thermal is nominal, throttling or unknown",
    )
    infer_bad("infer_reply_missing_frame", [pack(good)], "one output described, no frame")
    infer_bad("infer_reply_extra_frame", [pack(good), *two_frames], "one output, two frames")
    infer_bad(
        "infer_reply_short_frame",
        [pack(good), two_frames[0][:-1]],
        "the frame is shorter than its shape",
    )
    bad_dtype = ok_infer(17, [{**d_out, "dtype": "complex64"}])
    infer_bad(
        "infer_reply_bad_dtype", [pack(bad_dtype), two_frames[0]], "complex64 is not on the wire"
    )
    bad_shape = ok_infer(17, [{**d_out, "shape": [1, -2, 3]}])
    infer_bad(
        "infer_reply_negative_dim", [pack(bad_shape), two_frames[0]], "dimensions are non-negative"
    )
    infer_bad(
        "infer_reply_unknown_descriptor_key",
        [pack(ok_infer(17, [{**d_out, "scale": 1000}])), two_frames[0]],
        "an output descriptor has name, dtype and shape only (tensor_descriptor)",
    )
    infer_bad(
        "infer_reply_range_without_region",
        [pack(ok_infer(17, [{**d_out, "offset": 0, "nbytes": 24}])), two_frames[0]],
        "offset and nbytes belong to a region descriptor, which names its region",
    )
    infer_bad(
        "infer_reply_placed_unknown_key",
        [pack(ok_infer(9, [{**placed, "scale": 1000}, d_flags])), two_frames[1]],
        "a region descriptor has its range and no other key (region_tensor_descriptor)",
        [placed],
    )
    infer_bad(
        "infer_reply_output_twice",
        [pack(ok_infer(17, [d_out, dict(d_out)])), two_frames[0], two_frames[0]],
        "two outputs of one name: one would hide the other",
    )
    unasked = ok_infer(9, [placed])
    infer_bad(
        "infer_reply_unasked_region",
        [pack(unasked)],
        "an output written into a region the request did not name",
    )
    elsewhere = {**placed, "region": OTHER_REGION_ID}
    infer_bad(
        "infer_reply_other_region",
        [pack(unasked)],
        "written into another region than the one asked",
        [elsewhere],
    )
    infer_bad(
        "infer_reply_ok_null_id",
        [pack({**good, "id": None}), two_frames[0]],
        "only an error reply may have a null id",
    )
    bad_code = protocol.error_header(40, protocol.Code.INTERNAL, "x")
    bad_code["error"]["code"] = "TEAPOT"
    infer_bad("infer_reply_unknown_code", [pack(bad_code)], "not one of the protocol's codes")
    no_message = protocol.error_header(40, protocol.Code.INTERNAL, "x")
    del no_message["error"]["message"]
    infer_bad("infer_reply_error_without_message", [pack(no_message)], "message is required")

    # control replies: the result is the canonical form
    health = {
        "state": "degraded",
        "uptime_s": 12.5,
        "threads": {"engine_worker": True, "bus": True, "publisher": False},
        "models": {
            "demo": {
                "state": "serving",
                "runtime": "onnx_trt_ep",
                "fallback": True,
                "queue_depth": 3,
            },
            "broken": {"state": "failed", "runtime": None, "fallback": False, "queue_depth": 0},
        },
        "thermal": "unknown",
    }
    switch = {
        "model": "demo",
        "from_runtime": "onnx_trt_ep",
        "to_runtime": "onnx_trt_ep",
        "active_providers": ["CPUExecutionProvider"],
        "prepare_ms": 16.25,
        "swap_ms": 0.004,
    }
    switch_from_none = {**switch, "from_runtime": None, "prepare_ms": 3}
    describe = {
        "models": [
            {
                "name": "demo",
                "state": "serving",
                "inputs": [
                    {
                        "name": "image",
                        "dtype": "float32",
                        "shape": [None, 3, 224, 224],
                        "profile": {
                            "min_shape": [1, 3, 224, 224],
                            "opt_shape": [2, 3, 224, 224],
                            "max_shape": [4, 3, 224, 224],
                        },
                    }
                ],
                "outputs": [
                    {"name": "descriptors", "dtype": "float32", "shape": [None, 256, 28, 28]}
                ],
            },
            {"name": "broken", "state": "failed", "inputs": [], "outputs": []},
        ]
    }
    for name, op, result in (
        ("health_reply", "health", health),
        ("switch_reply", "runtime.switch", switch),
        ("switch_reply_from_none", "runtime.switch", switch_from_none),
        ("describe_reply", "describe", describe),
    ):
        vectors.add(
            name,
            "control_reply",
            [pack(protocol.ok_header(3, result=result))],
            op=op,
            expected=result,
        )
    denied = protocol.error_header(3, protocol.Code.PERMISSION_DENIED, "not an operator")
    vectors.add(
        "switch_reply_denied", "control_reply", [pack(denied)], op="runtime.switch", expected=denied
    )
    vectors.add(
        "health_reply_unknown_key",
        "control_reply",
        [pack(protocol.ok_header(3, result={**health, "load": 1}))],
        op="health",
        expected=MALFORMED,
        why="a key the protocol does not have",
    )
    vectors.add(
        "switch_reply_without_swap_ms",
        "control_reply",
        [pack(protocol.ok_header(3, result={k: v for k, v in switch.items() if k != "swap_ms"}))],
        op="runtime.switch",
        expected=MALFORMED,
        why="swap_ms is required",
    )

    # events: the payload is the canonical form
    stamp = {"ts_ns": 1_764_000_000_123_456_789, "seq": 42}
    thermal = {
        "source": "sysfs",
        "available": True,
        "throttle_active": True,
        "cpu_temp_c": 91.5,
        "gpu_temp_c": None,
        "clock_mhz": 1300,
        "measured_at_ns": 123_456_789,
        "transition": True,
        **stamp,
    }
    runtime = {
        "model": "demo",
        "state": "serving",
        "configured_runtime": "tensorrt",
        "runtime": "onnx_trt_ep",
        "fallback": True,
        "active_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
        "requested_providers": [
            "TensorrtExecutionProvider",
            "CUDAExecutionProvider",
            "CPUExecutionProvider",
        ],
        "provider_degradation": "no_tensorrt_ep",
        "engine_cache_error": None,
        "reason": "no TensorRT on this machine",
        **stamp,
    }
    alert = {
        "level": "WARNING",
        "code": "provider_degraded",
        "message": "model 'demo' runs without the TensorRT EP",
        "fields": {
            "model": "demo",
            "degradation": "cpu_only",
            "requested": ["A", "B"],
            "active": ["B"],
            "suppressed": 2,
        },
        **stamp,
    }
    build = {
        "buildId": "b1-000001",
        "eventSeq": 7,
        "type": "completed",
        "phaseId": None,
        "parentId": None,
        "name": None,
        "step": None,
        "numSteps": 12,
        "monotonicNs": 5_000,
        "wallNs": 1_764_000_000_000_000_000,
        "thread": "MainThread",
        "cancelState": "none",
        # The daemon's terminal event: the outcome's facts (event_build.json).
        "detail": {
            "cancelSource": None,
            "cancelReason": None,
            "escalated": False,
            "exitCode": 0,
            "summaryPath": "/var/lib/inferd/builds/b1/summary.json",
            "error": None,
            "killedAfterCommit": False,
            "timingCacheMode": "updated",
        },
        "model": "demo",
        "builder": "simulated",
        "simulated": True,
        "coalescedSteps": 3,
        **stamp,
    }
    health_event = {**health, **stamp}
    for topic, payload in (
        ("health", health_event),
        ("runtime", runtime),
        ("alert", alert),
        ("thermal", thermal),
        ("build", build),
    ):
        vectors.add(
            f"event_{topic}",
            "event",
            [topic.encode(), pack(payload)],
            topic=topic,
            expected=payload,
        )
    unavailable = {
        **thermal,
        "source": None,
        "available": False,
        "throttle_active": False,
        "cpu_temp_c": None,
        "clock_mhz": None,
        "transition": False,
    }
    vectors.add(
        "event_thermal_unavailable",
        "event",
        [b"thermal", pack(unavailable)],
        topic="thermal",
        expected=unavailable,
    )
    # The build's first event from its child: the timing-cache decision it started
    # with (detail.timingCacheMode, as build.status's timing_cache_start).
    build_start = {
        **build,
        "eventSeq": 1,
        "type": "phase_start",
        "phaseId": "p1",
        "name": "Building engine",
        "step": 0,
        "numSteps": 4,
        "thread": "inferd-build-b1-000001",
        "detail": {"timingCacheMode": "reused"},
        "coalescedSteps": 0,
    }
    vectors.add(
        "event_build_phase_start",
        "event",
        [b"build", pack(build_start)],
        topic="build",
        expected=build_start,
    )
    vectors.add(
        "event_build_unknown_timing_cache_mode",
        "event",
        [b"build", pack({**build_start, "detail": {"timingCacheMode": "warm"}})],
        topic="build",
        expected=MALFORMED,
        why="detail.timingCacheMode is one of the schema's words (or null)",
    )
    vectors.add(
        "event_payload_not_a_map",
        "event",
        [b"health", pack([1])],
        topic="health",
        expected=MALFORMED,
        why="a payload is a map",
    )
    vectors.add(
        "event_payload_not_msgpack",
        "event",
        [b"alert", b"\xc1"],
        topic="alert",
        expected=MALFORMED,
        why="0xc1 is never used in msgpack",
    )


def generate() -> Vectors:
    vectors = Vectors()
    requests(vectors)
    replies(vectors)
    return vectors


def write(vectors: Vectors, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in vectors.files.items():
        (out / name).write_bytes(data)
    manifest = {"version": protocol.PROTOCOL_VERSION, "vectors": vectors.entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "vectors")
    args = parser.parse_args(argv)
    write(generate(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
