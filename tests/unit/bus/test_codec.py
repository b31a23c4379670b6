"""Wire codec: client encoding and server-side validation, without sockets."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from inferd.bus.codec import Limits, check_request, decode_request, validate_inputs
from inferd.bus.request_options import deadline_ms_of
from inferd.types import OptimizationProfile, TensorSpec
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError

LIMITS = Limits(max_message_bytes=10_000_000, max_header_bytes=4096, max_frames=4)
SPECS = (TensorSpec("image", "float32", (None, 3, 4, 4)), TensorSpec("mask", "uint8", (4, 4)))


class Frame:
    """The part of zmq.Frame the codec uses."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)

    def __len__(self) -> int:
        return len(self.buffer)


def request(header: Any, *tensors: bytes) -> list[Frame]:
    packed = header if isinstance(header, bytes) else msgpack.packb(header)
    return [Frame(packed), *(Frame(t) for t in tensors)]


def valid_inputs() -> dict[str, np.ndarray]:
    return {
        "image": np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4),
        "mask": np.ones((4, 4), np.uint8),
    }


def encoded(inputs: dict[str, np.ndarray], **extra: Any) -> list[Frame]:
    descriptors, arrays = protocol.encode_tensors(inputs)
    header = {"v": 1, "id": 7, "op": "infer", "model": "m", "inputs": descriptors, **extra}
    return request(header, *(a.tobytes() for a in arrays))


def decode_and_validate(frames: list[Frame]) -> dict[str, np.ndarray]:
    """Through the typed decoder (the infer socket's path) and the reference
    checks alone: both give the same views or the same refusal."""
    outcomes = []
    for typed in (True, False):
        try:
            decoded = decode_request(frames, LIMITS, typed=typed)
            check_request(decoded, LIMITS)
            outcomes.append(validate_inputs(decoded.header, decoded.tensors, SPECS))
        except ProtocolError as exc:
            outcomes.append(exc)
    fast, reference = outcomes
    if isinstance(reference, ProtocolError):
        assert isinstance(fast, ProtocolError)
        assert (fast.code, fast.message) == (reference.code, reference.message)
        raise reference
    assert isinstance(fast, dict)
    assert fast.keys() == reference.keys()
    for name, view in reference.items():
        np.testing.assert_array_equal(fast[name], view)
        assert fast[name].dtype == view.dtype
    return reference


def test_valid_request_round_trips_zero_copy_read_only() -> None:
    inputs = valid_inputs()
    frames = encoded(inputs)
    arrays = decode_and_validate(frames)
    for name, value in inputs.items():
        np.testing.assert_array_equal(arrays[name], value)
        assert not arrays[name].flags.writeable
    for typed in (True, False):  # each input a view of its own frame, on both paths
        decoded = decode_request(frames, LIMITS, typed=typed)
        views = validate_inputs(decoded.header, decoded.tensors, SPECS)
        for frame, name in zip(frames[1:], inputs, strict=True):
            assert np.shares_memory(views[name], np.frombuffer(frame.buffer, np.uint8)), name


def test_big_endian_and_non_contiguous_inputs_are_normalised_by_the_client() -> None:
    image = np.asfortranarray(valid_inputs()["image"]).astype(">f4")
    descriptors, arrays = protocol.encode_tensors({"image": image})
    assert descriptors[0]["dtype"] == "float32"
    assert arrays[0].flags.c_contiguous and arrays[0].dtype.byteorder in "<="
    np.testing.assert_array_equal(arrays[0], image)


def test_client_refuses_unsendable_dtypes() -> None:
    with pytest.raises(ProtocolError, match="not sendable"):
        protocol.encode_tensors({"x": np.zeros(2, dtype=np.complex64)})


def expect(code: Code, fragment: str, frames: list[Frame]) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_and_validate(frames)
    assert caught.value.code == code
    assert fragment in caught.value.message


def mutate_descriptor(index: int, **changes: Any) -> list[Frame]:
    inputs = valid_inputs()
    descriptors, arrays = protocol.encode_tensors(inputs)
    descriptors[index].update(changes)
    header = {"v": 1, "id": 7, "op": "infer", "model": "m", "inputs": descriptors}
    return request(header, *(a.tobytes() for a in arrays))


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        (request(b""), "header frame is empty"),
        (request(b"\xc1garbage"), "not valid msgpack"),
        (request([1, 2, 3]), "must be a msgpack map"),
        (request({"id": 1, "op": "infer"}), "unsupported protocol version None"),
        (request({"v": 2, "id": 1, "op": "infer"}), "unsupported protocol version 2"),
        (request(b"\x81\x01\x02"), "not valid msgpack"),  # int map key: strict_map_key
        (request(b"x" * 5000), "the limit is 4096"),
    ],
)
def test_unreadable_headers(frames: list[Frame], fragment: str) -> None:
    expect(Code.INVALID_ARGUMENT, fragment, frames)


@pytest.mark.parametrize("bad_id", [True, 1.5, -1, -(2**63), "", "x" * 129, None, [1]])
def test_bad_ids_are_refused(bad_id: Any) -> None:
    expect(Code.INVALID_ARGUMENT, "'id' must be", request({"v": 1, "id": bad_id, "op": "infer"}))


def test_frame_count_and_size_limits() -> None:
    header = {"v": 1, "id": 1, "op": "infer"}
    expect(Code.INVALID_ARGUMENT, "the limit is 4", request(header, *([b"x"] * 5)))
    small = Limits(max_message_bytes=10, max_header_bytes=4096, max_frames=4)
    decoded = decode_request(request(header, b"x" * 11), small)
    with pytest.raises(ProtocolError, match="the limit is 10"):
        check_request(decoded, small)


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        (mutate_descriptor(0, dtype="float64"), "dtype float64 but the model expects float32"),
        (mutate_descriptor(0, dtype="object"), "dtype 'object' is not allowed"),
        (mutate_descriptor(0, dtype=">f4"), "dtype '>f4' is not allowed"),
        (mutate_descriptor(0, shape=[2, 3, 4]), "does not match the model's ['?', 3, 4, 4]"),
        (mutate_descriptor(0, shape=[2, 3, 4, 5]), "does not match"),
        (mutate_descriptor(0, shape=[2, -3, 4, 4]), "non-negative integers"),
        (mutate_descriptor(0, shape=[2, True, 4, 4]), "non-negative integers"),
        (mutate_descriptor(0, shape="2x3"), "'shape' must be a list"),
        (mutate_descriptor(0, shape=[1, 3, 4, 4]), "frame holds 384 bytes"),
        (mutate_descriptor(0, name="img"), "missing ['image'], unknown ['img']"),
        (mutate_descriptor(1, name="image"), "duplicate input names"),
        (mutate_descriptor(0, name=""), "'name' must be a non-empty string"),
    ],
)
def test_descriptor_violations(frames: list[Frame], fragment: str) -> None:
    expect(Code.INVALID_ARGUMENT, fragment, frames)


def test_frame_count_must_match_descriptors() -> None:
    frames = encoded(valid_inputs())
    expect(Code.INVALID_ARGUMENT, "describes 2 inputs but the message carries 1", frames[:2])


def test_truncated_tensor_frame_is_refused() -> None:
    frames = encoded(valid_inputs())
    frames[1] = Frame(bytes(frames[1].buffer)[:-4])
    expect(Code.INVALID_ARGUMENT, "frame holds 380 bytes", frames)


def test_inputs_must_be_a_list() -> None:
    header = {"v": 1, "id": 1, "op": "infer", "inputs": {"image": 1}}
    expect(Code.INVALID_ARGUMENT, "'inputs' must be a list", request(header))


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 25), (10, 10), (0.5, 1), (3_600_000, 3_600_000)]
)
def test_deadline_values(value: Any, expected: int) -> None:
    header = {} if value is None else {"deadline_ms": value}
    assert deadline_ms_of(header, 25) == expected


@pytest.mark.parametrize("value", [0, -1, "10", True, 3_600_001])
def test_bad_deadlines(value: Any) -> None:
    with pytest.raises(ProtocolError, match="deadline_ms"):
        deadline_ms_of({"deadline_ms": value}, 0)


def test_error_header_shape() -> None:
    header = protocol.error_header(None, Code.NOT_FOUND, "no model")
    assert header == {
        "v": 1,
        "id": None,
        "ok": False,
        "error": {"code": "NOT_FOUND", "message": "no model"},
    }


def test_ok_header_shape() -> None:
    header = protocol.ok_header("r-1", result={"state": "serving"})
    assert header == {"v": 1, "id": "r-1", "ok": True, "result": {"state": "serving"}}


PROFILED = (
    TensorSpec(
        "image",
        "float32",
        (None, 3, 4, 4),
        OptimizationProfile("image", (2, 3, 4, 4), (4, 3, 4, 4), (8, 3, 4, 4)),
    ),
)


@pytest.mark.parametrize("batch", [1, 9, 0])
def test_a_shape_outside_the_input_profile_is_refused(batch: int) -> None:
    """A dynamic dimension is accepted only within the input's optimisation profile:
    outside it ONNX Runtime's TensorRT EP would rebuild its engine inside the run."""
    image = np.zeros((batch, 3, 4, 4), np.float32)
    decoded = decode_request(encoded({"image": image}), LIMITS)
    with pytest.raises(ProtocolError) as refused:
        validate_inputs(decoded.header, decoded.tensors, PROFILED)
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert f"shape [{batch}, 3, 4, 4] is outside the model's optimisation profile" in (
        refused.value.message
    )
    assert "min [2, 3, 4, 4], max [8, 3, 4, 4]" in refused.value.message


@pytest.mark.parametrize("batch", [2, 5, 8])
def test_a_shape_within_the_profile_is_accepted(batch: int) -> None:
    image = np.ones((batch, 3, 4, 4), np.float32)
    decoded = decode_request(encoded({"image": image}), LIMITS)
    arrays = validate_inputs(decoded.header, decoded.tensors, PROFILED)
    assert arrays["image"].shape == (batch, 3, 4, 4)


def test_the_served_spec_carries_the_profile() -> None:
    assert PROFILED[0].as_wire() == {
        "name": "image",
        "dtype": "float32",
        "shape": [None, 3, 4, 4],
        "profile": {
            "min_shape": [2, 3, 4, 4],
            "opt_shape": [4, 3, 4, 4],
            "max_shape": [8, 3, 4, 4],
        },
    }
    assert "profile" not in SPECS[0].as_wire()


@pytest.mark.parametrize(
    "extra",
    [
        {b"model": "m"},
        {"build_config": {b"precison": "fp16", "workspace_bytes": 1}},
        {"inputs": [{"name": "x", b"dtype": "float32"}]},
        {"simulation": {"steps": [{b"fail": "x"}]}},
    ],
    ids=["top level", "nested map", "map in a list", "deeper"],
)
def test_a_bin_map_key_at_any_depth_is_refused_with_the_id_echoed(extra: dict[Any, Any]) -> None:
    """msgpack's strict_map_key lets bin keys through; one among str keys made the
    control handlers' ``sorted`` raise (INTERNAL).  Refused before any handler."""
    header = {"v": 1, "id": 9, "op": "build.start", **extra}
    frames = [Frame(msgpack.packb(header, use_bin_type=True))]
    decoded = decode_request(frames, LIMITS, typed=False)
    assert decoded.request_id == 9
    with pytest.raises(ProtocolError) as caught:
        check_request(decoded, LIMITS)
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert "map keys must be msgpack strings; found bytes b'" in caught.value.message
