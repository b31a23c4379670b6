"""An empty tensor whose other dimensions multiply past what an array can span
(numpy's ``intp``): its frame (0 bytes) or region range (``nbytes`` 0) passes the
length check, and viewing it raised ``ValueError``.  It is ``INVALID_ARGUMENT``
naming the tensor, on either header path, for inputs and placed outputs, and
the model's statistics count the refusal."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus.codec import Limits, check_descriptors, validate_inputs, validate_outputs
from inferd.bus.dispatch import Dispatcher
from inferd.bus.region_refs import bind_regions
from inferd.config import ModelConfig, ShmConfig
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Scheduler
from inferd.serving.slot import ModelSlot
from inferd.shm.regions import Connection, PeerCredentials, Region, RegionTable
from inferd.types import TensorSpec
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from tests.unit.bus.test_codec_regions import descriptor, request
from tests.unit.bus.test_shm_requests import sealed_memfd

#: No element, and 3 x (2**31 - 1)**2 float32s: far past 2**63 bytes.
TOO_WIDE = (0, 3, 2**31 - 1, 2**31 - 1)
#: No element, and within what an array may span: accepted as before.
WIDE = (0, 1, 2**31 - 1, 2**30)
DYNAMIC = (TensorSpec("x", "float32", (None, None, None, None)),)


def infer_header(shape: tuple[int, ...], request_id: int = 7) -> dict[str, Any]:
    inputs = [{"name": "x", "dtype": "float32", "shape": list(shape)}]
    return {"v": 1, "id": request_id, "op": "infer", "model": "m", "inputs": inputs}


@pytest.fixture
def loading() -> Iterator[tuple[Dispatcher, ModelSlot, Scheduler]]:
    """The real router and dispatcher, with model ``m`` still loading (no IO spec)."""
    slot = ModelSlot(ModelConfig(name="m", path=Path("m.onnx")))
    scheduler = Scheduler()
    scheduler.add_model("m", 4, "fifo")
    router = RequestRouter({"m": slot}, scheduler, {})
    yield Dispatcher(router, Limits(1 << 20, 1 << 16, 8), lambda: None), slot, scheduler
    scheduler.close()


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "dict"])
def test_an_empty_input_too_wide_to_view_is_invalid_argument_and_counted(
    loading: tuple[Dispatcher, ModelSlot, Scheduler], typed: bool
) -> None:
    dispatcher, slot, scheduler = loading
    header = infer_header(TOO_WIDE)
    if not typed:
        header["extra"] = True  # an unknown key: the typed decoder leaves it to the dict checks
    frames = [zmq.Frame(b"client"), zmq.Frame(protocol.pack(header)), zmq.Frame(b"")]
    reply = dispatcher.message(frames, typed=True)
    assert reply is not None
    error = reply.header["error"]
    assert reply.header["id"] == 7 and error["code"] == "INVALID_ARGUMENT", error
    assert "tensor 'x'" in error["message"] and str(list(TOO_WIDE)) in error["message"]
    snapshot = slot.stats.snapshot()
    assert snapshot["requests"] == 1 == sum(snapshot["responses"].values())
    assert scheduler.depth("m") == 0


def test_an_empty_input_an_array_can_span_is_still_accepted(
    loading: tuple[Dispatcher, ModelSlot, Scheduler],
) -> None:
    dispatcher, _slot, scheduler = loading
    frames = [zmq.Frame(b"client"), zmq.Frame(protocol.pack(infer_header(WIDE))), zmq.Frame(b"")]
    assert dispatcher.message(frames, typed=True) is None  # queued until the model serves
    assert scheduler.depth("m") == 1


def test_a_serving_models_dynamic_dimensions_do_not_let_one_through() -> None:
    empty = memoryview(b"")
    with pytest.raises(ProtocolError) as refused:
        validate_inputs(infer_header(TOO_WIDE), [empty], DYNAMIC)
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert validate_inputs(infer_header(WIDE), [empty], DYNAMIC)["x"].shape == WIDE


@pytest.fixture
def table() -> Iterator[tuple[RegionTable, Region]]:
    table = RegionTable(ShmConfig(socket=Path("/run/inferd/shm.sock")))
    fd = sealed_memfd()
    region = table.register(Connection(1, PeerCredentials(1, os.getuid(), 0)), fd, None)
    os.close(fd)
    yield table, region
    table.close_all()


def test_an_empty_placed_output_too_wide_to_view_is_refused_at_admission_and_late(
    table: tuple[RegionTable, Region],
) -> None:
    regions_table, region = table
    output = {**descriptor(region, 0, (0, 2**31 - 1, 2**31 - 1)), "name": "y"}
    header = {**infer_header((2, 4)), "outputs": [output]}
    header["inputs"] = [descriptor(region, 256, (2, 4))]
    regions = bind_regions(request(header), regions_table)
    assert regions is not None
    try:
        # While the model loads (its spec unknown): refused at once.
        with pytest.raises(ProtocolError) as at_admission:
            check_descriptors(header, [], regions)
        # Once it serves, with dynamic output dimensions (the worker's late check).
        with pytest.raises(ProtocolError) as late:
            validate_outputs(regions, (TensorSpec("y", "float32", (None, None, None)),))
    finally:
        regions.release()
    for refused in (at_admission.value, late.value):
        assert refused.code is Code.INVALID_ARGUMENT and "output 'y'" in refused.message
