"""A size the model names on several axes (ONNX ``dim_param``) is one size: a request
whose inputs, or whose placed outputs, give it different values is refused
``INVALID_ARGUMENT`` at admission, naming the tensors and the dimension, before it
is queued (ONNX Runtime would fail the run ``FAIL``, answered ``INTERNAL``).  On the
real router, region table, slot and ONNX Runtime (CPU): ``y = a + b``, all three
``[batch, 3]``."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from inferd.bus.codec import Limits, Request, check_request, decode_header, validate_parsed
from inferd.config import ModelConfig, RuntimeConfig, ShmConfig
from inferd.errors import InferenceError
from inferd.serving.requests import RequestRouter
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot, Sinks
from inferd.shm.regions import Connection, PeerCredentials, RegionTable
from inferd.types import ThermalState
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError

LIMITS = Limits(max_message_bytes=1 << 20, max_header_bytes=1 << 16, max_frames=4)
ME = PeerCredentials(os.getpid(), os.getuid(), os.getgid())
#: A shm connection's route: every output placed (``shm.connections.is_shm_route``).
SHM_ROUTE = b"\x00shm" + bytes(24)
#: Each tensor's place in the region: room for 16 rows of 3 float32.
SLOT_BYTES = 256


def pair_model(path: Path) -> Path:
    def tensor(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 3])

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "pair",
        [tensor("a"), tensor("b")],
        [tensor("y")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what every supported ONNX Runtime loads (1.17 on)
    onnx.save(model, path)
    return path


@dataclass
class Served:
    router: RequestRouter
    scheduler: Scheduler
    slot: ModelSlot
    region_id: str


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    slot = ModelSlot(ModelConfig(name="pair", path=pair_model(tmp_path / "pair.onnx")))
    sinks = Sinks(
        alert=lambda _alert: None,
        events=lambda _topic, _payload: None,
        record=lambda _kind, _payload: None,
        thermal=ThermalState.unavailable,
    )
    slot.activate(RuntimeConfig(ort_trt_cache_dir=tmp_path / "cache"), sinks)
    assert slot.state == "serving", slot.last_error
    scheduler = Scheduler()
    scheduler.add_model("pair", 8, "fifo")
    table = RegionTable(ShmConfig(socket=tmp_path / "shm.sock"))
    fd = os.memfd_create("inferd-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, os.sysconf("SC_PAGE_SIZE"))
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    region = table.register(Connection(1, ME), fd, "test")
    os.close(fd)
    router = RequestRouter({"pair": slot}, scheduler, {}, regions=table)
    yield Served(router, scheduler, slot, region.region_id)
    scheduler.close()
    table.close_all()
    slot.release()


def framed(a_batch: int, b_batch: int) -> Request:
    """An infer request on the infer socket, its inputs in frames."""
    descriptors, arrays = protocol.encode_tensors(
        {"a": np.ones((a_batch, 3), np.float32), "b": np.ones((b_batch, 3), np.float32)}
    )
    header = {"v": 1, "id": 1, "op": "infer", "model": "pair", "inputs": descriptors}
    request = decode_header(protocol.pack(header), LIMITS, typed=True)
    request.tensors = [memoryview(array.tobytes()) for array in arrays]
    check_request(request, LIMITS)
    request.envelope = [b"client"]
    return request


def on_shm(served: Served, a_batch: int, b_batch: int, y_batch: int) -> Request:
    """An infer request on ``shm.sock``: inputs and the output in the region."""

    def placed(index: int, name: str, batch: int) -> dict[str, Any]:
        return {
            "name": name,
            "dtype": "float32",
            "shape": [batch, 3],
            "region": served.region_id,
            "offset": index * SLOT_BYTES,
            "nbytes": batch * 3 * 4,
        }

    header = {
        "v": 1,
        "op": "infer",
        "model": "pair",
        "inputs": [placed(0, "a", a_batch), placed(1, "b", b_batch)],
        "outputs": [placed(2, "y", y_batch)],
        "id": 1,
    }
    request = decode_header(protocol.pack(header), LIMITS, typed=True)
    check_request(request, LIMITS)
    request.envelope = [SHM_ROUTE]
    request.local_uid = ME.uid
    return request


def refused(served: Served, request: Request) -> str:
    """The refusal's message, after checking that nothing was queued or left leased."""
    with pytest.raises(ProtocolError) as caught:
        served.router.handle_infer(request)
    assert caught.value.code is Code.INVALID_ARGUMENT, caught.value
    assert served.scheduler.depth("pair") == 0  # no engine time, no queue slot
    assert served.slot.stats.snapshot()["responses"] == {"INVALID_ARGUMENT": 1}
    return caught.value.message


def test_inputs_that_give_one_named_size_two_values_are_refused_naming_them(
    served: Served,
) -> None:
    message = refused(served, framed(2, 3))
    assert message == (
        "tensor 'b': dimension 0 is 3, but tensor 'a' has 2 at dimension 0; "
        "the model names both 'batch': they must be equal"
    )
    # What the check spares: ONNX Runtime fails such a run (answered INTERNAL).
    handle, runtime = served.slot.handle, served.slot.runtime
    assert handle is not None and runtime is not None
    with pytest.raises(InferenceError, match="broadcast"):  # FAIL or RUNTIME_EXCEPTION
        runtime.infer(handle, {"a": np.ones((2, 3), np.float32), "b": np.ones((3, 3), np.float32)})


def test_inputs_that_agree_are_admitted_and_run(served: Served) -> None:
    assert served.router.handle_infer(framed(2, 2)) is None
    job = served.scheduler.take(timeout=0)
    assert isinstance(job, Job) and job.inputs is not None
    handle, runtime = served.slot.handle, served.slot.runtime
    assert handle is not None and runtime is not None
    np.testing.assert_array_equal(runtime.infer(handle, job.inputs)["y"], np.full((2, 3), 2.0))
    job.finish()


def test_on_the_shm_socket_inputs_in_regions_are_checked_alike(served: Served) -> None:
    message = refused(served, on_shm(served, 2, 3, 2))
    assert "tensor 'b'" in message and "tensor 'a'" in message and "'batch'" in message


def test_a_placed_output_must_agree_with_the_inputs(served: Served) -> None:
    message = refused(served, on_shm(served, 2, 2, 3))
    assert message == (
        "output 'y': dimension 0 is 3, but tensor 'a' has 2 at dimension 0; "
        "the model names both 'batch': they must be equal"
    )
    assert served.router.handle_infer(on_shm(served, 2, 2, 2)) is None
    job = served.scheduler.take(timeout=0)
    assert isinstance(job, Job)
    job.finish()


def test_a_request_checked_once_its_model_serves_is_checked_alike(served: Served) -> None:
    # The engine worker validates a request that arrived while its model loaded.
    request = framed(2, 3)
    handle = served.slot.handle
    assert handle is not None
    parsed = [
        (descriptor.name, descriptor.dtype, np.dtype(descriptor.dtype), tuple(descriptor.shape))
        for descriptor in request.header.inputs  # type: ignore[union-attr]
    ]
    with pytest.raises(ProtocolError, match="the model names both 'batch'") as caught:
        validate_parsed(parsed, request.tensors, handle.inputs)
    assert caught.value.code is Code.INVALID_ARGUMENT
