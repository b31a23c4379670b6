"""Typed headers (``bus.headers``): the decoder accepts exactly the well-formed
infer headers and leaves every other one to the reference checks, so a request
gets the same answer (views, deadline, or code and message) either way; the
reply encoder writes the bytes ``protocol.pack(protocol.ok_header(...))`` does."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.bus import region_refs
from inferd.bus.codec import Limits, check_request, decode_request, model_of, validate_inputs
from inferd.bus.headers import InferHeader, InferReply, decode_infer, encode_infer_reply
from inferd.bus.region_refs import bind_regions
from inferd.bus.request_options import deadline_ms_of, reply_frame_bound_of
from inferd.config import ShmConfig
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd.types import TensorSpec
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import examples

LIMITS = Limits(max_message_bytes=10_000_000, max_header_bytes=4096, max_frames=4)
SPECS = (TensorSpec("x", "float32", (None, 4)),)
REGION = "0123456789abcdef0123456789abcdef"


class Frame:
    """The part of zmq.Frame the codec uses (no ZAP metadata: ``get`` refuses)."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)

    def __len__(self) -> int:
        return len(self.buffer)

    def get(self, name: str) -> str:
        raise zmq.ZMQError(errno.EINVAL)  # as zmq.Frame.get for a property it lacks


def good() -> dict[str, Any]:
    return {
        "v": 1,
        "id": 7,
        "op": "infer",
        "model": "m",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2, 4]}],
    }


def pipeline(header: Any, tensors: list[bytes], typed: bool) -> Any:
    """What the bus and ``RequestRouter.handle_infer`` do with an infer request
    (no region table), in their order; the outcome, or the refusal's code and message."""
    packed = header if isinstance(header, bytes) else msgpack.packb(header)
    frames = [Frame(packed), *(Frame(t) for t in tensors)]
    try:
        request = decode_request(frames, LIMITS, typed=typed)
        check_request(request, LIMITS)
        if not isinstance(model_of(request.header), str):
            raise ProtocolError(Code.INVALID_ARGUMENT, "'model' must be a string")
        regions = bind_regions(request, None)
        views = validate_inputs(request.header, request.tensors, SPECS, regions)
        deadline = deadline_ms_of(request.header, 25)
        reply_frame_bound = reply_frame_bound_of(request.header)
    except ProtocolError as exc:
        return ("refused", exc.code, exc.message)
    return (
        "ok",
        request.request_id,
        request.op,
        deadline,
        reply_frame_bound,
        {name: (view.dtype.str, view.shape, view.tobytes()) for name, view in views.items()},
    )


def same_answer(header: Any, tensors: list[bytes]) -> Any:
    fast = pipeline(header, tensors, typed=True)
    assert fast == pipeline(header, tensors, typed=False)
    return fast


TENSOR = np.arange(8, dtype=np.float32).tobytes()


def test_a_well_formed_header_is_typed() -> None:
    typed = decode_infer(msgpack.packb({**good(), "deadline_ms": 10}))
    assert isinstance(typed, InferHeader)
    assert (typed.id, typed.op, typed.model, typed.deadline_ms) == (7, "infer", "m", 10)
    assert same_answer({**good(), "deadline_ms": 10}, [TENSOR])[:4] == ("ok", 7, "infer", 10)


def test_a_reply_frame_bound_is_read_typed_and_given_to_the_job() -> None:
    header = {**good(), "max_reply_frame_bytes": 2**63 - 1}
    typed = decode_infer(msgpack.packb(header))
    assert typed is not None and typed.max_reply_frame_bytes == 2**63 - 1
    assert same_answer(header, [TENSOR])[:5] == ("ok", 7, "infer", 25, 2**63 - 1)
    assert same_answer(good(), [TENSOR])[4] is None  # absent: no bound
    unbound = {**good(), "max_reply_frame_bytes": None}
    assert decode_infer(msgpack.packb(unbound)) is not None
    assert same_answer(unbound, [TENSOR])[4] is None
    assert decode_infer(msgpack.packb({"v": 1, "id": "a" * 128, "op": "describe"})) is not None


def changed(**fields: Any) -> dict[str, Any]:
    header = good()
    for key, value in fields.items():
        if value is DROP:
            del header[key]
        else:
            header[key] = value
    return header


def descriptor(**fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": "x", "dtype": "float32", "shape": [2, 4]}
    for key, value in fields.items():
        if value is DROP:
            del entry[key]
        else:
            entry[key] = value
    return entry


DROP = object()

#: Headers the typed decoder leaves to the reference checks, with the refusal
#: those give (None: the contract accepts it, and so does the daemon).
LEFT_TO_THE_REFERENCE: dict[str, tuple[Any, str | None]] = {
    # wrong types
    "v as a string": (changed(v="1"), "unsupported protocol version '1'"),
    "v true": (changed(v=True), "unsupported protocol version True"),
    "v 1.0 (accepted)": (changed(v=1.0), None),
    "op a number": (changed(op=3), "'op' must be a string"),
    "model a number": (changed(model=3), "'model' must be a string"),
    "inputs a map": (changed(inputs={"x": 1}), "'inputs' must be a list of tensor descriptors"),
    "descriptor a list": (changed(inputs=[[1]]), "tensor #0: descriptor must be a map"),
    "name a number": (changed(inputs=[descriptor(name=1)]), "'name' must be a non-empty string"),
    # missing keys
    "no v": (changed(v=DROP), "unsupported protocol version None"),
    "no id": (changed(id=DROP), "'id' must be an unsigned 64-bit integer"),
    "no op": (changed(op=DROP), "'op' must be a string"),
    "no dtype": (changed(inputs=[descriptor(dtype=DROP)]), "dtype None is not allowed"),
    "no shape": (changed(inputs=[descriptor(shape=DROP)]), "'shape' must be a list"),
    # extra keys: the contract ignores them, so the reference checks accept them
    "extra header key (accepted)": (changed(trace="abc"), None),
    "extra descriptor key (accepted)": (changed(inputs=[descriptor(layout="nchw")]), None),
    # dtypes and shapes
    "dtype object": (changed(inputs=[descriptor(dtype="object")]), "dtype 'object' is not allowed"),
    "dtype >f4": (changed(inputs=[descriptor(dtype=">f4")]), "dtype '>f4' is not allowed"),
    "empty name": (changed(inputs=[descriptor(name="")]), "'name' must be a non-empty string"),
    "shape a string": (changed(inputs=[descriptor(shape="2x4")]), "'shape' must be a list"),
    "17 dims": (changed(inputs=[descriptor(shape=[1] * 17)]), "at most 16 dimensions"),
    "negative dim": (changed(inputs=[descriptor(shape=[-2, 4])]), "non-negative integers"),
    "bool dim": (changed(inputs=[descriptor(shape=[True, 4])]), "non-negative integers"),
    "float dim": (changed(inputs=[descriptor(shape=[2.0, 4])]), "non-negative integers"),
    "dim 2**31": (changed(inputs=[descriptor(shape=[2**31, 4])]), "non-negative integers"),
    # ids
    "id true": (changed(id=True), "'id' must be"),
    "id negative": (changed(id=-1), "'id' must be"),
    "id float": (changed(id=1.5), "'id' must be"),
    "id empty": (changed(id=""), "'id' must be"),
    "id 129 chars": (changed(id="x" * 129), "'id' must be"),
    "id null": (changed(id=None), "'id' must be"),
    # deadline_ms
    "deadline 0": (changed(deadline_ms=0), "'deadline_ms' must be in (0, 3600000], got 0"),
    "deadline -1": (changed(deadline_ms=-1), "got -1"),
    "deadline over": (changed(deadline_ms=3_600_001), "got 3600001"),
    "deadline nan": (changed(deadline_ms=float("nan")), "got nan"),
    "deadline string": (changed(deadline_ms="10"), "'deadline_ms' must be a number"),
    "deadline true": (changed(deadline_ms=True), "'deadline_ms' must be a number"),
    # max_reply_frame_bytes
    "reply bound 0": (changed(max_reply_frame_bytes=0), "must be an integer in [1, "),
    "reply bound -1": (changed(max_reply_frame_bytes=-1), "got -1"),
    "reply bound 2**63": (changed(max_reply_frame_bytes=2**63), f"got {2**63}"),
    "reply bound true": (changed(max_reply_frame_bytes=True), "got True"),
    "reply bound float": (changed(max_reply_frame_bytes=1024.0), "got 1024.0"),
    "reply bound string": (changed(max_reply_frame_bytes="1024"), "got '1024'"),
    # regions (this daemon has none: refused once the references are well formed)
    "region null": (changed(inputs=[descriptor(region=None)]), "'region' must be 32 lowercase"),
    "outputs null (accepted)": (changed(outputs=None), None),
    "outputs a map": (changed(outputs={}), "'outputs' must be a list of region descriptors"),
}


@pytest.mark.parametrize(
    ("header", "fragment"), LEFT_TO_THE_REFERENCE.values(), ids=LEFT_TO_THE_REFERENCE.keys()
)
def test_what_the_decoder_leaves_gets_the_reference_answer(
    header: dict[str, Any], fragment: str | None
) -> None:
    assert decode_infer(msgpack.packb(header)) is None
    answer = same_answer(header, [TENSOR])
    if fragment is None:
        assert answer[0] == "ok"
    else:
        assert answer[:2] == ("refused", Code.INVALID_ARGUMENT)
        assert fragment in answer[2]


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x93\x01\x02\x03", b"\x81\x01\x02", msgpack.packb(good())[:-3], b"x" * 5000],
    ids=["empty", "reserved byte", "an array", "int key", "truncated", "over the limit"],
)
def test_unreadable_headers_get_the_reference_answer(data: bytes) -> None:
    assert same_answer(data, [TENSOR])[0] == "refused"


TYPED_BUT_REFUSED = {
    # Well formed, so typed; what depends on the model or the frames is checked after.
    # (describe has no inputs, so the decoder leaves their absence to the op)
    "no inputs": (changed(inputs=DROP), "'inputs' must be a list of tensor descriptors"),
    "unknown input": (changed(inputs=[descriptor(name="y")]), "missing ['x'], unknown ['y']"),
    "model's dtype": (changed(inputs=[descriptor(dtype="int8")]), "dtype int8 but the model"),
    "model's shape": (changed(inputs=[descriptor(shape=[2, 5])]), "does not match the model's"),
    "frame length": (changed(inputs=[descriptor(shape=[1, 4])]), "frame holds 32 bytes"),
    "region named": (
        changed(inputs=[descriptor(region=REGION, offset=0, nbytes=32)]),
        "this daemon serves no shared-memory regions",
    ),
    "offset alone": (changed(inputs=[descriptor(offset=0)]), "['offset'] given without a 'region'"),
    "misaligned offset": (
        changed(inputs=[descriptor(region=REGION, offset=8, nbytes=32)]),
        "offset 8 is not a multiple of 256",
    ),
    "bad region id": (
        changed(inputs=[descriptor(region="ABC", offset=0, nbytes=32)]),
        "'region' must be 32 lowercase hex digits",
    ),
}


@pytest.mark.parametrize(
    ("header", "fragment"), TYPED_BUT_REFUSED.values(), ids=TYPED_BUT_REFUSED.keys()
)
def test_typed_headers_are_still_checked_against_the_model(
    header: dict[str, Any], fragment: str
) -> None:
    assert decode_infer(msgpack.packb(header)) is not None
    answer = same_answer(header, [TENSOR])
    assert answer[0] == "refused"
    assert fragment in answer[2]


def test_duplicate_keys_take_the_last_value_on_both_paths() -> None:
    # {v: 1, id: 5, op: "infer", model: "m", inputs: [...], id: 9}: msgpack and
    # msgspec both keep the last value of a repeated key.
    body = msgpack.packb(good())[1:]
    data = bytes([0x86]) + body + msgpack.packb("id") + msgpack.packb(9)
    assert decode_infer(data) is not None
    assert same_answer(data, [TENSOR])[1] == 9


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.sampled_from(["infer", "describe", "m", "x", "float32", "int8", "", REGION]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
DESCRIPTORS = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.sampled_from(["x", "y", ""]), VALUES),
        "dtype": st.one_of(st.sampled_from(["float32", "int8", "object"]), VALUES),
        "shape": st.one_of(
            st.lists(st.integers(min_value=-1, max_value=8), max_size=3), st.just([2, 4]), VALUES
        ),
        "region": st.one_of(st.just(REGION), VALUES),
        "offset": st.one_of(st.just(0), VALUES),
        "nbytes": st.one_of(st.just(32), VALUES),
        "extra": VALUES,
    },
)
HEADERS = st.fixed_dictionaries(
    {},
    optional={
        "v": st.one_of(st.just(1), VALUES),
        "id": st.one_of(st.just(7), VALUES),
        "op": st.one_of(st.sampled_from(["infer", "describe"]), VALUES),
        "model": st.one_of(st.just("m"), VALUES),
        "inputs": st.one_of(st.lists(DESCRIPTORS, max_size=2), VALUES),
        "outputs": st.one_of(st.lists(DESCRIPTORS, max_size=1), VALUES),
        "deadline_ms": st.one_of(st.integers(-2, 3_600_002), st.floats(), VALUES),
        "max_reply_frame_bytes": st.one_of(st.integers(-1, 2**64 - 1), VALUES),
        "extra": VALUES,
    },
)


@settings(max_examples=examples(600), deadline=None)
@given(HEADERS, st.integers(min_value=0, max_value=2))
def test_generated_headers_get_the_same_answer_on_both_paths(
    header: dict[str, Any], frames: int
) -> None:
    same_answer(header, [TENSOR] * frames)


@settings(max_examples=examples(300), deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_get_the_same_answer_on_both_paths(data: bytes) -> None:
    same_answer(data, [TENSOR])


# -- replies -------------------------------------------------------------------
REPLY_CASES = {
    "small id": dict(request_id=7, late=False, latency_us=12, queue_us=0),
    "uint64 id, late": dict(request_id=2**64 - 1, late=True, latency_us=2**33, queue_us=70_000),
    "string id": dict(request_id="req-é" * 20, late=False, latency_us=255, queue_us=65_536),
}


@pytest.mark.parametrize("case", REPLY_CASES.values(), ids=REPLY_CASES.keys())
@pytest.mark.parametrize("region_output", [False, True])
def test_the_reply_encoder_writes_ok_headers_byte_for_byte(
    case: dict[str, Any], region_output: bool
) -> None:
    descriptors, _ = protocol.encode_tensors({"y": np.zeros((2, 300), np.float16)})
    if region_output:
        descriptors.append(
            {"name": "z", "dtype": "int8", "shape": [4], "region": REGION}
            | {"offset": 256, "nbytes": 4}
        )
    fields: dict[str, Any] = dict(
        model="identity",
        runtime="onnxruntime:CPUExecutionProvider",
        fallback=region_output,
        latency_us=case["latency_us"],
        queue_us=case["queue_us"],
        thermal="nominal",
        late=case["late"],
        outputs=descriptors,
    )
    expected = protocol.pack(protocol.ok_header(case["request_id"], **fields))
    packed = encode_infer_reply(InferReply(v=1, id=case["request_id"], ok=True, **fields))
    assert packed == expected
    assert list(msgpack.unpackb(packed)) == list(protocol.ok_header(case["request_id"], **fields))


# -- region references: the typed checks and the dict path agree ---------------------
@pytest.fixture
def region_table() -> Iterator[tuple[RegionTable, str]]:
    table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, mmap.PAGESIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    region = table.register(Connection(1, PeerCredentials(1, os.getuid(), 0)), fd, None)
    os.close(fd)
    yield table, region.region_id
    table.close_all()


def bound(header: dict[str, Any], table: RegionTable, typed: bool) -> Any:
    frames = [Frame(msgpack.packb(header))]
    try:
        request = decode_request(frames, LIMITS, typed=typed)
        assert isinstance(request.header, InferHeader) == typed
        regions = bind_regions(request, table)
    except ProtocolError as exc:
        return ("refused", exc.code, exc.message)
    if regions is None:
        return None
    try:
        return (
            {index: ref for index, (_, ref) in regions.inputs.items()},
            [(p.name, p.dtype, p.shape, p.ref) for p in regions.outputs],
        )
    finally:
        regions.release()


ALIGNED = "(region-backed tensors are 256-byte aligned)"


def region_cases(region: str) -> dict[str, dict[str, Any]]:
    def placed(name: str = "x", offset: int = 0, **extra: Any) -> dict[str, Any]:
        return {**descriptor(name=name), "region": region, "offset": offset, "nbytes": 32, **extra}

    return {
        "input and output": changed(inputs=[placed()], outputs=[placed("y", 256)]),
        "input only": changed(inputs=[placed()]),
        "output only": changed(outputs=[placed("y", 256)]),
        "no outputs listed": changed(outputs=[]),
        "misaligned": changed(inputs=[placed(offset=8)]),
        "outside the region": changed(inputs=[placed(offset=mmap.PAGESIZE)]),
        "unknown region": changed(inputs=[{**placed(), "region": "f" * 32}]),
        "uppercase id": changed(inputs=[{**placed(), "region": region.upper()}]),
        "no nbytes": changed(inputs=[{k: v for k, v in placed().items() if k != "nbytes"}]),
        "wrong nbytes": changed(outputs=[placed("y", 256, nbytes=16)]),
        "output twice": changed(outputs=[placed("y", 256), placed("y", 512)]),
        "output without region": changed(outputs=[descriptor(name="y")]),
        "overlap": changed(inputs=[placed()], outputs=[placed("y", 0)]),
        "65 tensors": changed(outputs=[placed(f"y{i}", 0) for i in range(65)]),
    }


def test_region_references_get_the_same_answer_on_both_paths(
    region_table: tuple[RegionTable, str],
) -> None:
    table, region = region_table
    answers = {}
    for what, header in region_cases(region).items():
        answers[what] = bound(header, table, typed=True)
        assert answers[what] == bound(header, table, typed=False), what
        assert table.status()["regions"][0]["in_use"] == 0, what  # nothing stays leased
    assert answers["input only"] is not None and answers["input only"][0][0].offset == 0
    assert answers["no outputs listed"] is None  # an empty list places nothing
    assert answers["misaligned"][2].endswith("offset 8 is not a multiple of 256 " + ALIGNED)
    assert answers["wrong nbytes"][0] == "refused"


def test_well_formed_references_skip_the_dict_path(
    region_table: tuple[RegionTable, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    table, region = region_table
    cases = region_cases(region)

    def refused(header: dict[str, Any]) -> None:
        raise AssertionError("the dict path ran")

    monkeypatch.setattr(region_refs, "_dict_refs", refused)
    assert bound(good(), table, typed=True) is None  # frames only: nothing to bind
    for what in ("input and output", "input only", "output only"):
        assert bound(cases[what], table, typed=True) is not None
    assert bound(cases["no outputs listed"], table, typed=True) is None  # places nothing
    with pytest.raises(AssertionError, match="the dict path ran"):
        bound(cases["misaligned"], table, typed=True)


def test_the_reply_struct_has_the_schemas_keys_in_the_schemas_order() -> None:
    schemas = Path(__file__).resolve().parents[3] / "schemas" / "bus"
    ok = json.loads((schemas / "infer_reply.json").read_text())["$defs"]["ok"]
    base = json.loads((schemas / "common.json").read_text())["$defs"]["ok_reply_base"]
    fields = list(InferReply.__struct_fields__)
    # The schema lists them in the order the worker has always written them
    # (ok_header(...)'s keywords), which the struct keeps byte for byte.
    assert fields == [*base["required"], *ok["required"]]
    assert list(ok["properties"]) == ok["required"]
