"""Region-backed tensors in the codec (``region_refs.bind_regions``, ``validate_inputs``,
``validate_outputs``): every malformed reference is a specific refusal that leaves
nothing leased, and valid ones are zero-copy views of the region."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd.bus.codec import (
    Request,
    check_descriptors,
    validate_inputs,
    validate_outputs,
)
from inferd.bus.region_refs import bind_regions, peer_uid_of
from inferd.config import ShmConfig
from inferd.shm.regions import Connection, PeerCredentials, Region, RegionTable
from inferd.types import Peer, TensorSpec
from inferd_wire.protocol import Code, ProtocolError

PAGE = mmap.PAGESIZE


def user_id(uid: int | None, transport: str = "ipc") -> str:
    """The ``User-Id`` metadata the ZAP handler gives a verified connection."""
    return json.dumps(Peer(transport, uid=uid).as_record(), separators=(",", ":"))  # type: ignore[arg-type]


SPECS_IN = (TensorSpec("x", "float32", (None, 4)),)
SPECS_OUT = (TensorSpec("y", "float32", (None, 4)),)


@pytest.fixture
def table() -> Iterator[tuple[RegionTable, Region]]:
    table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, PAGE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    region = table.register(Connection(1, PeerCredentials(1, os.getuid(), 0)), fd, None)
    os.close(fd)
    yield table, region
    table.close_all()


class Frame:
    """What the bus hands the codec as a header frame: ``get`` reads metadata and,
    like ``zmq.Frame.get``, raises ``zmq.ZMQError`` for a property it lacks."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self._metadata = metadata

    def get(self, name: str) -> str:
        if name not in self._metadata:
            raise zmq.ZMQError(errno.EINVAL)
        return self._metadata[name]


def request(
    header: dict[str, Any], tensors: list[memoryview] | None = None, **meta: str
) -> Request:
    return Request([b"peer"], header, 1, "infer", tensors or [], header_frame=Frame(meta))


def descriptor(
    region: Region, offset: int = 0, shape: tuple[int, ...] = (2, 4), **extra: Any
) -> dict[str, Any]:
    nbytes = int(np.prod(shape)) * 4
    return {
        "name": "x",
        "dtype": "float32",
        "shape": list(shape),
        "region": region.region_id,
        "offset": offset,
        "nbytes": nbytes,
        **extra,
    }


def header(inputs: list[Any], outputs: list[Any] | None = None) -> dict[str, Any]:
    fields: dict[str, Any] = {"v": 1, "id": 1, "op": "infer", "model": "m", "inputs": inputs}
    if outputs is not None:
        fields["outputs"] = outputs
    return fields


def test_requests_without_regions_bind_nothing(table: tuple[RegionTable, Region]) -> None:
    plain = header([{"name": "x", "dtype": "float32", "shape": [2, 4]}])
    assert bind_regions(request(plain), table[0]) is None
    assert bind_regions(request(plain), None) is None


def test_inputs_and_outputs_in_a_region_are_views_of_it(table: tuple[RegionTable, Region]) -> None:
    regions_table, region = table
    x = descriptor(region)
    y = {**descriptor(region, offset=256), "name": "y"}
    message = request(header([x], [y]))
    regions = bind_regions(message, regions_table)
    assert regions is not None and region.leases == 1  # one lease per region per request
    base = region.host_array()
    base[:32].view(np.float32)[:] = np.arange(8)
    inputs = validate_inputs(message.header, [], SPECS_IN, regions)
    outputs = validate_outputs(regions, SPECS_OUT)
    assert np.shares_memory(inputs["x"], base) and np.shares_memory(outputs["y"], base)
    assert inputs["x"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not inputs["x"].flags.writeable and outputs["y"].flags.writeable
    outputs["y"][:] = inputs["x"] * 2
    assert base[256:288].view(np.float32).tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    regions.release()
    assert region.leases == 0


def test_frames_count_only_the_inputs_not_in_a_region(table: tuple[RegionTable, Region]) -> None:
    regions_table, region = table
    two = header([descriptor(region), {"name": "z", "dtype": "float32", "shape": [1]}])
    regions = bind_regions(request(two), regions_table)
    check_descriptors(two, [memoryview(np.ones(1, np.float32).tobytes())], regions)
    with pytest.raises(ProtocolError, match=r"1 inputs in frames \(and 1 in regions\)"):
        check_descriptors(two, [], regions)
    assert regions is not None
    regions.release()


def refusal(
    table: RegionTable, region: Region, message: Request, code: Code, fragment: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        bind_regions(message, table)
    assert caught.value.code == code, caught.value
    assert fragment in caught.value.message, caught.value.message
    assert region.leases == 0  # nothing stays leased after a refusal


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"region": "f" * 31}, "32 lowercase hex digits"),
        ({"region": "A" * 32}, "32 lowercase hex digits"),
        ({"offset": 100}, "not a multiple of 256"),
        ({"offset": -256}, "non-negative integer"),
        ({"offset": True}, "non-negative integer"),
        ({"nbytes": 2**63}, "non-negative integer"),
        ({"offset": PAGE}, "outside region"),
        ({"offset": PAGE - 256, "nbytes": 512}, "outside region"),
    ],
)
def test_malformed_input_references_are_invalid_argument(
    table: tuple[RegionTable, Region], change: dict[str, Any], fragment: str
) -> None:
    regions_table, region = table
    message = request(header([{**descriptor(region), **change}]))
    refusal(regions_table, region, message, Code.INVALID_ARGUMENT, fragment)


def test_offset_or_nbytes_without_a_region_is_invalid(table: tuple[RegionTable, Region]) -> None:
    regions_table, region = table
    for key in ("offset", "nbytes"):
        stray = {"name": "y", "dtype": "float32", "shape": [1], key: 0}
        message = request(header([descriptor(region), stray]))
        refusal(regions_table, region, message, Code.INVALID_ARGUMENT, "without a 'region'")


def test_nbytes_must_be_exactly_the_shapes(table: tuple[RegionTable, Region]) -> None:
    regions_table, region = table
    short = {**descriptor(region), "nbytes": 28}
    message = request(header([short]))
    regions = bind_regions(message, regions_table)
    with pytest.raises(ProtocolError, match="'nbytes' is 28 but shape"):
        validate_inputs(message.header, [], SPECS_IN, regions)
    assert regions is not None
    regions.release()
    bad_output = {**descriptor(region, offset=256), "name": "y", "nbytes": 28}
    refusal(
        regions_table,
        region,
        request(header([], [bad_output])),
        Code.INVALID_ARGUMENT,
        "'nbytes' is 28",
    )


def test_unknown_and_foreign_regions(table: tuple[RegionTable, Region]) -> None:
    regions_table, region = table
    unknown = request(header([{**descriptor(region), "region": "0" * 32}]))
    refusal(regions_table, region, unknown, Code.NOT_FOUND, "no region 00000000")
    foreign = request(header([descriptor(region)]), **{"User-Id": user_id(os.getuid() + 1)})
    refusal(regions_table, region, foreign, Code.PERMISSION_DENIED, f"uid {os.getuid()}")
    own = request(header([descriptor(region)]), **{"User-Id": user_id(os.getuid())})
    regions = bind_regions(own, regions_table)
    assert regions is not None
    regions.release()


def test_a_daemon_without_shared_memory_says_so(table: tuple[RegionTable, Region]) -> None:
    with pytest.raises(ProtocolError) as caught:
        bind_regions(request(header([descriptor(table[1])])), None)
    assert caught.value.code == Code.NOT_FOUND and "[shm] enabled = false" in caught.value.message


def test_outputs_overlapping_other_tensors_are_refused(table: tuple[RegionTable, Region]) -> None:
    regions_table, region = table
    x = descriptor(region)  # bytes 0..32
    y = {**descriptor(region, offset=0), "name": "y"}
    refusal(regions_table, region, request(header([x], [y])), Code.INVALID_ARGUMENT, "overlap")
    twice = {**descriptor(region, offset=256), "name": "y"}
    refusal(
        regions_table, region, request(header([x], [twice, twice])), Code.INVALID_ARGUMENT, "twice"
    )
    # Inputs may share bytes: nothing writes them.
    shared = request(header([x, {**x, "name": "z"}]))
    regions = bind_regions(shared, regions_table)
    assert regions is not None
    regions.release()


def test_outputs_are_checked_against_the_model(table: tuple[RegionTable, Region]) -> None:
    regions_table, region = table
    for change, fragment in (
        ({"name": "nope"}, "the model's outputs are ['y']"),
        ({"dtype": "int32"}, "dtype int32 but the model expects float32"),
        ({"shape": [2, 2], "nbytes": 16}, "does not match the model's"),
    ):
        output = {**descriptor(region, offset=256), "name": "y", **change}
        regions = bind_regions(request(header([], [output])), regions_table)
        assert regions is not None
        with pytest.raises(ProtocolError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            validate_outputs(regions, SPECS_OUT)
        regions.release()
    not_placed = {"name": "y", "dtype": "float32", "shape": [1]}
    refusal(
        regions_table,
        region,
        request(header([], [not_placed])),
        Code.INVALID_ARGUMENT,
        "only outputs placed",
    )


def test_the_peer_uid_comes_from_zap_metadata_when_there_is_some() -> None:
    assert peer_uid_of(Frame({"User-Id": user_id(1000)})) == 1000
    assert peer_uid_of(Frame({"User-Id": user_id(None, "tcp")})) is None  # no uid: not checked
    assert peer_uid_of(Frame({"User-Id": "alice"})) is None  # not the ZAP handler's record
    assert peer_uid_of(Frame({})) is None
    assert peer_uid_of(None) is None
    import zmq

    assert peer_uid_of(zmq.Frame(b"header")) is None  # no ZAP handler: no metadata


def test_a_request_names_at_most_64_tensors_in_regions(table: tuple[RegionTable, Region]) -> None:
    regions_table, region = table
    inputs = [{**descriptor(region), "name": f"x{i}"} for i in range(65)]
    refusal(
        regions_table, region, request(header(inputs)), Code.INVALID_ARGUMENT, "the limit is 64"
    )
    outputs = [{**descriptor(region, offset=256 * i), "name": f"y{i}"} for i in range(65)]
    refusal(
        regions_table, region, request(header([], outputs)), Code.INVALID_ARGUMENT, "limit is 64"
    )
