"""Shared-memory tensors against a real daemon: inputs and outputs in a client's
region with no tensor bytes on the socket, and every malformed use (unknown or
foreign region, out-of-bounds or misaligned ranges, unsealed or truncated
memory, double unregister, limits, a client killed mid-request) answered with a
clear code while the daemon keeps serving and frees what the client held."""

from __future__ import annotations

import fcntl
import functools
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from inferd.demo_model import DEMO_INPUT, DEMO_INPUT_SHAPE, DEMO_OUTPUT, DEMO_OUTPUT_SHAPE
from inferd_client import (
    InferenceClient,
    OperatorClient,
    RemoteError,
    RequestTimeout,
    SharedRegion,
    cli_format,
)
from inferd_client.shm import RegionChannel
from inferd_wire import protocol
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES, shown
from tests.conftest import (
    HANG_S,
    REPO,
    DaemonProcess,
    LingeringSocket,
    make_memfd,
    memfds_mapped,
    render_config,
    start_daemon,
    stopped,
    wait_until,
    write_slow_model,
)
from tests.conftest import inferctl as shared_inferctl
from tests.integration.test_schemas import assert_valid
from tests.integration.wire import RawDealer, RawShm, assert_error, pack

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
LIMIT_BYTES = 64 * MIB
LIMITS = {
    "max_connections": 4,
    "max_regions_per_connection": 4,
    "max_bytes_per_uid": LIMIT_BYTES,
    "max_bytes_total": LIMIT_BYTES,
}
SLOW = (512, 512)


@pytest.fixture(scope="module")
def served(demo_model: Path, identity_model: Path) -> Iterator[DaemonProcess]:
    """demo (fixed shapes), identity (dynamic batch) and slow (tens of ms a request)."""
    workdir = Path(tempfile.mkdtemp(prefix="ifd-shm-"))
    slow = write_slow_model(workdir / "slow.onnx")
    models = [
        {"name": "demo", "path": str(demo_model)},
        {"name": "identity", "path": str(identity_model)},
        {"name": "slow", "path": str(slow)},
    ]
    daemon = start_daemon(render_config(workdir, models, shm=LIMITS), workdir)
    try:
        yield daemon
        assert daemon.stop() == 0, daemon.log()  # shutdown releases what is still registered
        assert "shm_region_still_viewed" not in daemon.log()
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def daemon(served: DaemonProcess) -> Iterator[DaemonProcess]:
    """The module's daemon; after each test, every region of it is gone again."""
    yield served
    wait_until(lambda: shm_status(served)["regions"] == [], message="no region left")
    assert shm_status(served)["mapped_bytes"] == 0


def shm_status(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=5) as operator:
        status: dict[str, Any] = operator.status()["shm"]
    return status


def shm_path(daemon: DaemonProcess) -> str:
    return str(daemon.workdir / "run" / "shm.sock")


def serves(daemon: DaemonProcess) -> None:
    """The daemon still answers an ordinary request correctly."""
    x = np.full((1, 3, 224, 224), 0.5, np.float32)
    with InferenceClient(daemon.infer, timeout=10) as client:
        assert np.array_equal(client.infer("identity", {"input": x})["output"], x)


def demo_reference(demo_model: Path, image: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run([DEMO_OUTPUT], {DEMO_INPUT: image})[0])


# -- the normal path ------------------------------------------------------------------


def test_inputs_and_outputs_in_a_region_match_onnx_runtime_with_no_tensor_frames(
    daemon: DaemonProcess, demo_model: Path
) -> None:
    with InferenceClient(daemon.infer, timeout=10) as client:
        region = client.shared_region(8 * MIB, label="camera0")
        image = region.array(DEMO_INPUT_SHAPE, np.float32)
        image[:] = np.random.default_rng(3).random(DEMO_INPUT_SHAPE, dtype=np.float32)
        descriptors = region.array(DEMO_OUTPUT_SHAPE, np.float32)
        result = client.infer("demo", {DEMO_INPUT: image}, outputs={DEMO_OUTPUT: descriptors})
        assert result[DEMO_OUTPUT] is descriptors  # written in place
        np.testing.assert_allclose(
            descriptors, demo_reference(demo_model, np.array(image)), rtol=1e-5, atol=1e-6
        )
        [described] = client.last_reply["outputs"]
        assert described["region"] == next(iter(client._regions))
        status = shm_status(daemon)
        [shown] = status["regions"]
        assert shown["label"] == "camera0" and shown["owner"]["pid"] == os.getpid()
        assert shown["in_use"] == 0 and status["mapped_bytes"] == region.nbytes
        assert len(memfds_mapped(daemon.process.pid)) == 1
    # The client went: its region is released and unmapped.
    wait_until(lambda: shm_status(daemon)["regions"] == [], message="the region released")
    assert (
        memfds_mapped(daemon.process.pid) == []
        and shm_status(daemon)["released_on_disconnect"] >= 1
    )


def test_on_the_wire_the_reply_is_the_header_alone_and_both_match_the_schemas(
    daemon: DaemonProcess,
) -> None:
    region = SharedRegion(4 * MIB)
    channel = RegionChannel(shm_path(daemon))
    try:
        region_id = channel.register(region)
        x = region.array((2, 3, 224, 224), np.float32)
        x[:] = 1.5
        y = region.array((2, 3, 224, 224), np.float32)
        header = {
            "v": 1,
            "id": 7,
            "op": "infer",
            "model": "identity",
            "inputs": [
                {
                    "name": "input",
                    "dtype": "float32",
                    "shape": [2, 3, 224, 224],
                    "region": region_id,
                    "offset": 0,
                    "nbytes": x.nbytes,
                },
            ],
            "outputs": [
                {
                    "name": "output",
                    "dtype": "float32",
                    "shape": [2, 3, 224, 224],
                    "region": region_id,
                    "offset": region.locate(y)[0],
                    "nbytes": y.nbytes,
                },  # type: ignore[index]
            ],
        }
        assert_valid("infer_request.json", header)
        with RawDealer(daemon.infer) as dealer:
            reply, frames = dealer.request([pack(header)], timeout=10)
        assert reply["ok"] is True and frames == []  # no tensor bytes on the socket
        assert_valid("infer_reply.json", reply)
        assert reply["outputs"] == header["outputs"]
        assert (y == 1.5).all()
        with OperatorClient(daemon.control) as operator:
            status = operator.call("status")
        assert_valid("status_reply.json#/$defs/ok", {"v": 1, "id": 1, "ok": True, "result": status})
    finally:
        channel.close()
        region.close()


def test_a_request_with_every_tensor_in_a_region_travels_on_the_shm_socket(
    daemon: DaemonProcess, demo_model: Path
) -> None:
    before = shm_status(daemon)
    with InferenceClient(daemon.infer, timeout=10) as client:
        region = client.shared_region(8 * MIB, label="camera1")
        image = region.array(DEMO_INPUT_SHAPE, np.float32)
        descriptors = region.array(DEMO_OUTPUT_SHAPE, np.float32)
        rng = np.random.default_rng(5)
        for attempt in range(3):
            image[:] = rng.random(DEMO_INPUT_SHAPE, dtype=np.float32)
            result = client.infer("demo", {DEMO_INPUT: image}, outputs={DEMO_OUTPUT: descriptors})
            # The first reply names the model's outputs; then the shm socket carries it.
            assert client.last_transport == ("infer" if attempt == 0 else "shm")
            assert result[DEMO_OUTPUT] is descriptors
            np.testing.assert_allclose(
                descriptors, demo_reference(demo_model, np.array(image)), rtol=1e-5, atol=1e-6
            )
        assert_valid("shm_reply.json", client.last_reply)
        assert_valid("infer_reply.json", client.last_reply)
        assert len(client._shm_requests) == 1  # encoded once, sent twice
        status = shm_status(daemon)
        assert status["requests"] - before["requests"] == 2
        assert status["replies"] - before["replies"] == 2 and status["in_flight"] == 0
    with InferenceClient(daemon.infer, timeout=10) as client:  # describe names them too
        client.describe()
        region = client.shared_region(8 * MIB)
        image = region.array(DEMO_INPUT_SHAPE, np.float32)
        image[:] = 0.25
        descriptors = region.array(DEMO_OUTPUT_SHAPE, np.float32)
        client.infer("demo", {DEMO_INPUT: image}, outputs={DEMO_OUTPUT: descriptors})
        assert client.last_transport == "shm"
        plain = client.infer("demo", {DEMO_INPUT: np.array(image)})  # a frame: the infer socket
        assert client.last_transport == "infer"
        np.testing.assert_array_equal(plain[DEMO_OUTPUT], descriptors)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="the client's window does not poll on one CPU (tests/unit/client/test_poll_window.py)",
)
def test_replies_polled_for_in_their_window_are_the_daemons_and_the_window_is_accounted(
    daemon: DaemonProcess,
) -> None:
    rng = np.random.default_rng(9)
    # A window as wide as allowed: it opens soon after the send, so replies land
    # in it; on a loaded machine a late wake-up may find a few there before it,
    # so the client sends at least 20 and then until one was caught.
    with InferenceClient(daemon.infer, timeout=10, reply_spin_us=10_000) as client:
        region = client.shared_region(4 * MIB)
        x = region.array((1, 3, 224, 224), np.float32)
        y = region.array((1, 3, 224, 224), np.float32)
        client.infer("identity", {"input": x}, outputs={"output": y})  # names the outputs
        requests = 0
        give_up = time.monotonic() + HANG_S
        while requests < 20 or (client.reply_spin["caught"] == 0 and time.monotonic() < give_up):
            x[:] = rng.random(x.shape, dtype=np.float32)
            client.infer("identity", {"input": x}, outputs={"output": y})
            requests += 1
            assert client.last_transport == "shm"
            np.testing.assert_array_equal(y, x)
        spin = client.reply_spin
    # The first shm reply is waited for as ever (nothing learned); each later one
    # went through a window: caught in it, there before it, or not in it.
    assert spin["caught"] >= 1
    assert spin["caught"] + spin["early"] + spin["missed"] == requests - 1
    # Each window ends at its close, but a loaded machine may preempt the thread in
    # its last poll past it: 0.2 s in all for that, far below a window never closed.
    assert spin["spent_us"] <= (requests - 1) * 10_000 + 200_000
    with InferenceClient(daemon.infer, reply_spin_us=0) as off:
        assert off.reply_spin == {"us": 0, "caught": 0, "early": 0, "missed": 0, "spent_us": 0}


def test_a_request_encoded_for_the_shm_socket_is_not_reused_once_its_region_goes(
    daemon: DaemonProcess,
) -> None:
    with InferenceClient(daemon.infer, timeout=10) as client:
        client.describe()
        region = client.shared_region(4 * MIB)
        x = region.array((1, 3, 224, 224), np.float32)
        y = region.array((1, 3, 224, 224), np.float32)
        x[:] = 4.0
        assert (
            client.infer("identity", {"input": x}, outputs={"output": y})["output"] == 4.0
        ).all()
        assert client.last_transport == "shm" and client._shm_requests
        client.unregister_region(region)  # the daemon lets it go: the arrays are plain memory
        assert client._shm_requests == {}
        x[:] = 5.0
        result = client.infer("identity", {"input": x}, outputs={"output": y})
        assert client.last_transport == "infer" and result["output"] is y and (y == 5.0).all()


def in_region(name: str, array: np.ndarray, region_id: str, offset: int) -> dict[str, Any]:
    """A float32 region descriptor of ``array`` at ``offset`` of region ``region_id``."""
    return {
        "name": name,
        "dtype": "float32",
        "shape": list(array.shape),
        "region": region_id,
        "offset": offset,
        "nbytes": array.nbytes,
    }


def shm_infer(
    region_id: str, x: np.ndarray, y: np.ndarray | None, offsets: tuple[int, int], **extra: Any
) -> dict[str, Any]:
    header: dict[str, Any] = {
        "v": 1,
        "id": 21,
        "op": "infer",
        "model": "identity",
        "inputs": [in_region("input", x, region_id, offsets[0])],
        **extra,
    }
    if y is not None:
        header["outputs"] = [in_region("output", y, region_id, offsets[1])]
    return header


def test_on_the_shm_socket_every_output_is_placed_and_refusals_are_clear(
    daemon: DaemonProcess,
) -> None:
    with SharedRegion(4 * MIB) as region, RawShm(shm_path(daemon)) as raw:
        registered = raw.call({"v": 1, "id": 1, "op": "register"}, [region.fd])
        region_id = registered["result"]["region"]
        x = region.array((1, 3, 224, 224), np.float32)
        x[:] = 2.0
        y = region.array((1, 3, 224, 224), np.float32)
        offsets = (region.locate(x)[0], region.locate(y)[0])  # type: ignore[index]
        ok = shm_infer(region_id, x, y, offsets)
        assert_valid("shm_request.json", ok)
        reply = raw.call(ok)
        assert reply["ok"] is True and reply["outputs"] == ok["outputs"] and (y == 2.0).all()
        unplaced = shm_infer(region_id, x, None, offsets)
        assert_error(
            raw.call(unplaced), "INVALID_ARGUMENT", "not placed: ['output']", request_id=21
        )
        framed = shm_infer(region_id, x, y, offsets)
        del (
            framed["inputs"][0]["region"],
            framed["inputs"][0]["offset"],
            framed["inputs"][0]["nbytes"],
        )
        assert_error(raw.call(framed), "INVALID_ARGUMENT", "0 tensor frames", request_id=21)
        assert_error(
            raw.call({**ok, "model": "nope"}), "NOT_FOUND", "no model named 'nope'", request_id=21
        )
        foreign = shm_infer("0123456789abcdef" * 2, x, y, offsets)
        assert_error(raw.call(foreign), "NOT_FOUND", "no region 01234567", request_id=21)
        outside = shm_infer(region_id, x, y, (4 * MIB - 256, offsets[1]))
        assert_error(raw.call(outside), "INVALID_ARGUMENT", "outside region", request_id=21)
        assert shm_status(daemon)["in_flight"] == 0
    serves(daemon)


def test_a_repeated_request_is_admitted_from_its_first_admission_and_checked_as_ever(
    daemon: DaemonProcess,
) -> None:
    def admitted_prepared() -> int:
        with OperatorClient(daemon.control, timeout=5) as operator:
            status = operator.status()
        assert_valid("status_reply.json", {"v": 1, "id": 1, "ok": True, "result": status})
        count: int = status["bus"]["admitted_prepared"]
        return count

    before = admitted_prepared()
    with SharedRegion(4 * MIB) as region, RawShm(shm_path(daemon)) as raw:
        region_id = raw.call({"v": 1, "id": 1, "op": "register"}, [region.fd])["result"]["region"]
        x = region.array((1, 3, 224, 224), np.float32)
        y = region.array((1, 3, 224, 224), np.float32)
        header = shm_infer(region_id, x, y, (region.locate(x)[0], region.locate(y)[0]))  # type: ignore[index]
        del header["id"]  # the id goes last, as the client encodes a repeated request
        for request_id in range(2, 12):
            x[:] = float(request_id)  # a camera filling the same buffer in place
            reply = raw.call({**header, "id": request_id})
            assert reply["ok"] is True and reply["id"] == request_id and (y == request_id).all()
        assert admitted_prepared() - before == 9  # all but the first
        unregistered = raw.call({"v": 1, "id": 20, "op": "unregister", "region": region_id})
        assert unregistered["ok"] is True
        # The same bytes again: its region is gone, and it is refused as any request.
        assert_error(raw.call({**header, "id": 21}), "NOT_FOUND", "no region", request_id=21)
        assert shm_status(daemon)["in_flight"] == 0
    serves(daemon)


def test_a_deadline_passing_in_the_queue_is_answered_on_the_shm_socket(
    daemon: DaemonProcess,
) -> None:
    with SharedRegion(8 * MIB) as region, RawShm(shm_path(daemon)) as raw:
        region_id = raw.call({"v": 1, "id": 1, "op": "register"}, [region.fd])["result"]["region"]
        tensors = [region.array(SLOW, np.float32) for _ in range(4)]
        for tensor in tensors:
            tensor[:] = 1.0
        headers = []
        for index in (0, 1):  # the first runs for tens of ms; the second waits behind it
            x, y = tensors[2 * index], tensors[2 * index + 1]
            header: dict[str, Any] = {
                "v": 1,
                "id": 30 + index,
                "op": "infer",
                "model": "slow",
                "inputs": [in_region("x", x, region_id, region.locate(x)[0])],  # type: ignore[index]
                "outputs": [in_region("y", y, region_id, region.locate(y)[0])],  # type: ignore[index]
            }
            if index:
                header["deadline_ms"] = 1
            headers.append(header)
        raw.socket.send(pack(headers[0]))
        raw.socket.send(pack(headers[1]))
        replies = {}
        for _ in (0, 1):  # the expired one is answered at once, before the running one
            reply = protocol.unpack_header(raw.socket.recv(MAX_SHM_MESSAGE_BYTES))
            replies[reply["id"]] = reply
        assert_error(replies[31], "DEADLINE_EXCEEDED", "deadline passed", request_id=31)
        assert replies[30]["ok"] is True
    serves(daemon)


def test_registration_messages_match_the_schemas(daemon: DaemonProcess) -> None:
    with SharedRegion(mmap.PAGESIZE) as region, RawShm(shm_path(daemon)) as raw:
        request = {"v": 1, "id": 1, "op": "register", "label": "x"}
        assert_valid("shm_request.json", request)
        registered = raw.call(request, [region.fd])
        assert_valid("shm_reply.json", registered)
        unregister = {"v": 1, "id": 2, "op": "unregister", "region": registered["result"]["region"]}
        assert_valid("shm_request.json", unregister)
        assert_valid("shm_reply.json", raw.call(unregister))
        refused = raw.call(unregister)
        assert_valid("shm_reply.json", refused)
        assert refused["error"]["code"] == "NOT_FOUND"


# -- malformed requests naming regions ------------------------------------------------


def region_request(region_id: str, **change: Any) -> dict[str, Any]:
    descriptor = {
        "name": "input",
        "dtype": "float32",
        "shape": [1, 3, 224, 224],
        "region": region_id,
        "offset": 0,
        "nbytes": 602112,
        **change,
    }
    return {"v": 1, "id": 11, "op": "infer", "model": "identity", "inputs": [descriptor]}


@pytest.mark.parametrize(
    ("change", "code", "fragment"),
    [
        ({"region": "0123456789abcdef" * 2}, "NOT_FOUND", "no region 01234567"),
        ({"region": "not-an-id"}, "INVALID_ARGUMENT", "32 lowercase hex digits"),
        ({"offset": 4 * MIB}, "INVALID_ARGUMENT", "outside region"),
        ({"offset": 4 * MIB - 256, "nbytes": 512, "shape": [128]}, "INVALID_ARGUMENT", "outside"),
        ({"offset": 64}, "INVALID_ARGUMENT", "not a multiple of 256"),
        ({"nbytes": 602112 - 4}, "INVALID_ARGUMENT", "'nbytes' is 602108"),
        ({"nbytes": -1}, "INVALID_ARGUMENT", "non-negative integer"),
        ({"dtype": "float64", "nbytes": 1204224}, "INVALID_ARGUMENT", "dtype float64"),
    ],
    ids=[
        "unknown",
        "malformed-id",
        "offset-outside",
        "end-outside",
        "misaligned",
        "nbytes-short",
        "nbytes-negative",
        "dtype",
    ],
)
def test_malformed_region_references_are_refused_and_the_daemon_serves_on(
    daemon: DaemonProcess, change: dict[str, Any], code: str, fragment: str
) -> None:
    with SharedRegion(4 * MIB) as region:
        channel = RegionChannel(shm_path(daemon))
        try:
            region_id = channel.register(region)
            with RawDealer(daemon.infer) as dealer:
                reply, frames = dealer.request([pack(region_request(region_id, **change))])
            assert_error(reply, code, fragment, request_id=11)
            assert frames == []
            assert shm_status(daemon)["regions"][0]["in_use"] == 0  # nothing leased
        finally:
            channel.close()
    serves(daemon)


def test_outputs_that_overlap_or_come_out_another_shape_are_refused(daemon: DaemonProcess) -> None:
    with InferenceClient(daemon.infer, timeout=10) as client:
        region = client.shared_region(8 * MIB)
        x = region.array((2, 3, 224, 224), np.float32)
        x[:] = 2.0
        y = region.array((1, 3, 224, 224), np.float32)  # batch 1 for a batch-2 output
        with pytest.raises(RemoteError) as caught:
            client.infer("identity", {"input": x}, outputs={"output": y})
        assert caught.value.code == "INVALID_ARGUMENT"
        # the identity model names its input's and output's batch alike (DESIGN.md 195)
        assert "dimension 0 is 1, but tensor 'input' has 2" in caught.value.message
        overlapping = x.reshape(-1)[: x.size].reshape(x.shape)  # the input's own bytes
        with pytest.raises(RemoteError) as overlap:
            client.infer("identity", {"input": x}, outputs={"output": overlapping})
        assert overlap.value.code == "INVALID_ARGUMENT" and "overlap" in overlap.value.message
        assert (x == 2.0).all()
    serves(daemon)


def test_a_region_of_another_client_is_a_capability_and_cannot_be_unregistered_by_it(
    daemon: DaemonProcess,
) -> None:
    """Same uid: knowing the id is the right to use the region (the ZAP peer uid,
    when known, must be the owner's: PERMISSION_DENIED, tested in the codec's unit
    tests); only the registering connection may unregister it."""
    owner = InferenceClient(daemon.infer, timeout=10)
    try:
        region = owner.shared_region(4 * MIB)
        region_id = next(iter(owner._regions))
        x = region.array((1, 3, 224, 224), np.float32)
        x[:] = 4.0
        with RawDealer(daemon.infer) as other:
            reply, frames = other.request([pack(region_request(region_id))], timeout=10)
        assert reply["ok"] is True and np.frombuffer(frames[0], np.float32)[0] == 4.0
        thief = RegionChannel(shm_path(daemon))
        try:
            with pytest.raises(RemoteError) as caught:
                thief.unregister(region_id)
            assert caught.value.code == "NOT_FOUND"
            assert "not registered on this connection" in caught.value.message
        finally:
            thief.close()
        assert [r["state"] for r in shm_status(daemon)["regions"]] == ["registered"]
    finally:
        owner.close()


# -- registration refusals ----------------------------------------------------------------


def unregister_of_size(size: int) -> bytes:
    """An unregister of an unknown region whose message is exactly ``size`` bytes."""
    header = {"v": 1, "id": 1, "op": "unregister", "region": ""}
    fill = size - len(pack(header))
    while len(message := pack({**header, "region": "r" * fill})) > size:
        fill -= 1  # a longer string takes a longer length prefix
    assert len(message) == size
    return message


def test_registration_refusals_are_clear_and_the_connection_stays_usable(
    daemon: DaemonProcess,
) -> None:
    register = {"v": 1, "id": 1, "op": "register"}
    unsealed = make_memfd(mmap.PAGESIZE)
    read, write = os.pipe()
    odd = make_memfd(mmap.PAGESIZE + 1)
    fcntl.fcntl(odd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    try:
        with RawShm(shm_path(daemon)) as raw, SharedRegion(mmap.PAGESIZE) as good:
            for fds, header, fragment in [
                ([unsealed], register, "F_SEAL_SHRINK"),
                ([read], register, "not a memfd"),
                ([odd], register, "multiple of the page size"),
                ([], register, "none came"),
                ([good.fd, good.fd], register, "at most one descriptor"),
                (
                    [good.fd],
                    {"v": 1, "id": 1, "op": "unregister", "region": "0" * 32},
                    "carries no",
                ),
                ([], {"v": 1, "id": 1, "op": "steal"}, "unknown op"),
                ([], {"v": 1, "id": 1, "op": "register", "label": "\n"}, "printable"),
                ([], {"v": 2, "id": 1, "op": "register"}, "protocol version"),
            ]:
                reply = raw.call(header, fds)
                assert_error(reply, "INVALID_ARGUMENT", fragment, request_id=1)
            oversized = raw.exchange(b"\x81\xa1v" + b"\x01" * MAX_SHM_MESSAGE_BYTES)
            assert_error(oversized, "INVALID_ARGUMENT", f"over {MAX_SHM_MESSAGE_BYTES} bytes")
            # The bound is exact: a message of that many bytes is read, one more is not.
            for size, fragment in (
                (MAX_SHM_MESSAGE_BYTES, "32 lowercase hex digits"),  # read and decoded
                (MAX_SHM_MESSAGE_BYTES + 1, f"over {MAX_SHM_MESSAGE_BYTES} bytes"),
            ):
                reply = raw.exchange(unregister_of_size(size))
                assert fragment in reply["error"]["message"], (size, reply)
            garbage = raw.exchange(b"\xc1")
            assert_error(garbage, "INVALID_ARGUMENT", "not valid msgpack")
            assert raw.exchange(b"")["error"]["code"] == "INVALID_ARGUMENT"  # not the end
            assert shm_status(daemon)["regions"] == []  # nothing was mapped
            accepted = raw.call(register, [good.fd])
            assert accepted["ok"] is True
            assert shm_status(daemon)["refused"]["INVALID_ARGUMENT"] >= 11
    finally:
        for fd in (unsealed, read, write, odd):
            os.close(fd)
    serves(daemon)


def test_a_descriptor_whose_close_blocks_holds_up_no_request(daemon: DaemonProcess) -> None:
    """A client can pass a descriptor whose close blocks as long as it likes (a
    lingering TCP socket): the daemon closes it on a thread of its own, and goes on
    serving and answering status meanwhile (DESIGN.md 120)."""
    lingering = LingeringSocket()
    try:
        with RawShm(shm_path(daemon)) as raw:
            unregister = {"v": 1, "id": 1, "op": "unregister", "region": "0" * 32}
            with stopped(daemon.process.pid):  # so that the daemon's copy is the last
                socket.send_fds(raw.socket, [pack(unregister)], [lingering.sock.fileno()])
                lingering.sock.close()
            reply = protocol.unpack_header(raw.socket.recv(MAX_SHM_MESSAGE_BYTES))
            assert_error(reply, "INVALID_ARGUMENT", "carries no descriptor", request_id=1)
        wait_until(
            lambda: shm_status(daemon)["closing"]["blocked_s"] > 0, message="a close under way"
        )
        serves(daemon)
        assert shm_status(daemon)["closing"]["blocked_s"] > 0  # served while it still blocks
        wait_until(
            lambda: lingering.drain() or shm_status(daemon)["closing"]["waiting"] == 0,
            message="every close done once the peer reads",
        )
        assert shm_status(daemon)["closing"]["blocked_s"] == 0
    finally:
        lingering.close()


def test_a_client_that_shuts_down_its_side_still_gets_every_reply(daemon: DaemonProcess) -> None:
    """``shutdown(SHUT_WR)`` after the last request: the daemon reads no more, answers
    every request in flight, then closes the connection and releases its region."""
    count, unroutable = 6, shm_status(daemon)["unroutable_replies"]
    with SharedRegion(4 * MIB, label="half-closed") as region, RawShm(shm_path(daemon)) as raw:
        region_id = raw.call({"v": 1, "id": 1, "op": "register"}, [region.fd])["result"]["region"]
        x = region.array(SLOW, np.float32)
        x[:] = 2.0
        ref, out = in_region("x", x, region_id, 0), in_region("y", x, region_id, 2 * MIB)
        for number in range(2, count + 2):
            header = {"v": 1, "id": number, "op": "infer", "model": "slow"}
            raw.socket.send(pack({**header, "inputs": [ref], "outputs": [out]}))
        raw.socket.shutdown(socket.SHUT_WR)
        answered: list[int] = []
        while reply_bytes := raw.socket.recv(MAX_SHM_MESSAGE_BYTES):  # b"": closed by it
            reply = protocol.unpack_header(reply_bytes)
            assert reply["ok"] is True, reply
            answered.append(reply["id"])
    assert sorted(answered) == list(range(2, count + 2))  # each once
    assert shm_status(daemon)["unroutable_replies"] == unroutable


def test_truncating_or_unmapping_a_registered_region_cannot_hurt_the_daemon(
    daemon: DaemonProcess,
) -> None:
    with InferenceClient(daemon.infer, timeout=10) as client:
        region = client.shared_region(4 * MIB)
        x = region.array((2, 3, 224, 224), np.float32)
        x[:] = 3.0
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, 0)  # sealed: the kernel refuses
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, mmap.PAGESIZE)
        y = region.array((2, 3, 224, 224), np.float32)
        assert (
            client.infer("identity", {"input": x}, outputs={"output": y})["output"] == 3.0
        ).all()
        # The client unmaps and closes its side; the daemon's mapping keeps the pages.
        region_id = next(iter(client._regions))
        offset = region.locate(y)
        assert offset is not None
        del x, y
        region.close()
        with RawDealer(daemon.infer) as dealer:
            reply, _ = dealer.request(
                [pack(region_request(region_id, offset=offset[0]))], timeout=10
            )
        assert reply["ok"] is True
    serves(daemon)


def test_double_unregister_is_not_found(daemon: DaemonProcess) -> None:
    with InferenceClient(daemon.infer, timeout=10) as client:
        region = client.shared_region(mmap.PAGESIZE)
        region_id = next(iter(client._regions))
        client.unregister_region(region)
        assert client._shm is not None
        with pytest.raises(RemoteError) as caught:
            client._shm.unregister(region_id)
        assert caught.value.code == "NOT_FOUND" and "already unregistered" in caught.value.message
        with RawDealer(daemon.infer) as dealer:
            reply, _ = dealer.request([pack(region_request(region_id))])
        assert_error(reply, "NOT_FOUND", "no region", request_id=11)
    serves(daemon)


def test_limits_are_resource_exhausted(daemon: DaemonProcess) -> None:
    with InferenceClient(daemon.infer, timeout=10) as client:
        client.shared_region(LIMIT_BYTES // 2)
        with pytest.raises(RemoteError) as caught:
            client.shared_region(LIMIT_BYTES // 2 + mmap.PAGESIZE)
        assert caught.value.code == "RESOURCE_EXHAUSTED"
        assert "shm.max_bytes_per_uid" in caught.value.message
        for _ in range(LIMITS["max_regions_per_connection"] - 1):
            client.shared_region(mmap.PAGESIZE)
        with pytest.raises(RemoteError) as regions:
            client.shared_region(mmap.PAGESIZE)
        assert regions.value.code == "RESOURCE_EXHAUSTED"
        assert "max_regions_per_connection" in regions.value.message
        channels = [RegionChannel(shm_path(daemon)) for _ in range(LIMITS["max_connections"] - 1)]
        try:
            with SharedRegion(mmap.PAGESIZE) as extra:
                refused = RegionChannel(shm_path(daemon))
                with pytest.raises(RemoteError) as connections:
                    refused.register(extra)
                refused.close()
            assert connections.value.code == "RESOURCE_EXHAUSTED"
            assert "shm.max_connections" in connections.value.message
        finally:
            for channel in channels:
                channel.close()
        serves(daemon)


# -- a client killed mid-request ----------------------------------------------------------

CHILD = """
import sys, time
import numpy as np
import zmq
from inferd_client import InferenceClient
from inferd_client.shm import encode_inputs, placed_outputs
from inferd_wire import protocol
client = InferenceClient(sys.argv[1], shm_socket=sys.argv[2])
region = client.shared_region(32 * 1024 * 1024, label="doomed")
sent = 0
arrays = []
for _ in range(12):  # queue work on the slow model, all of it in the region
    x = region.array((512, 512), np.float32)
    x[:] = 1.0
    y = region.array((512, 512), np.float32)
    arrays.append((x, y))
    descriptors, frames = encode_inputs({"x": x}, client._regions)
    header = {"v": 1, "id": sent + 1, "op": "infer", "model": "slow", "inputs": descriptors,
              "outputs": placed_outputs({"y": y}, client._regions)}
    if sys.argv[3] == "shm":
        client._shm._socket.send(protocol.pack(header))
    else:
        client._channel._socket.send_multipart([protocol.pack(header)])
    sent += 1
print("sent", flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("transport", ["infer", "shm"])
def test_a_client_killed_mid_request_is_cleaned_up_and_the_daemon_serves_on(
    daemon: DaemonProcess, transport: str
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, daemon.infer, shm_path(daemon), transport],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "sent"
        # Its requests hold the region (queued or running) when it dies.
        wait_until(
            lambda: any(r["in_use"] for r in shm_status(daemon)["regions"]),
            message="the region in use",
        )
        unroutable = shm_status(daemon)["unroutable_replies"]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        status = shm_status(daemon)
        assert status["regions"] == [] or status["regions"][0]["label"] == "doomed"
        # Released once the requests that use it are answered; then unmapped.
        wait_until(lambda: shm_status(daemon)["regions"] == [], message="the region released")
        assert shm_status(daemon)["mapped_bytes"] == 0 and memfds_mapped(daemon.process.pid) == []
        if transport == "shm":  # answered after its connection closed: counted, not lost
            assert shm_status(daemon)["unroutable_replies"] > unroutable
            assert shm_status(daemon)["in_flight"] == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    serves(daemon)
    assert "shm_region_still_viewed" not in daemon.log()


# -- a region made by another process -----------------------------------------------

CAPTURE = """
import os, sys
import numpy as np
fd = int(sys.argv[1])
frame = np.full((1, 3, 224, 224), 2.5, np.float32)
os.pwrite(fd, frame.tobytes(), 0)
"""


def test_a_memfd_filled_by_another_process_is_adopted_and_inferred_on_in_place(
    daemon: DaemonProcess,
) -> None:
    """A capture service fills a memfd it shares; the client adopts it, registers
    it, and the daemon reads the frame and writes the output in it: no copy."""
    fd = os.memfd_create("capture", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4 * MIB)
    subprocess.run([sys.executable, "-c", CAPTURE, str(fd)], pass_fds=[fd], check=True)
    with InferenceClient(daemon.infer, timeout=10) as client:
        region = SharedRegion.adopt(fd, label="capture")
        try:
            client.register_region(region)
            frame = region.array((1, 3, 224, 224), np.float32)  # the bytes already there
            out = region.array((1, 3, 224, 224), np.float32)
            for _ in range(2):  # the first on the infer socket, by reference; then shm.sock
                out[...] = 0.0
                result = client.infer("identity", {"input": frame}, outputs={"output": out})
                assert result["output"] is out and (out == 2.5).all()
            assert client.last_transport == "shm"
            assert shm_status(daemon)["regions"][0]["label"] == "capture"
        finally:
            client.unregister_region(region)
            region.close()


# -- shutdown -----------------------------------------------------------------------


def test_shutdown_answers_every_request_in_flight_then_releases_every_region(
    short_tmp_path: Path,
) -> None:
    """SIGTERM with a region registered and a queue of requests placed in it: each
    request is answered once (run in the drain, else ``UNAVAILABLE``), then the
    connection closes, the region is released and the daemon exits 0."""
    workdir = short_tmp_path
    slow = write_slow_model(workdir / "slow.onnx")
    config = render_config(
        workdir,
        [{"name": "slow", "path": str(slow)}],
        daemon={"shutdown_drain_ms": 0},  # what has not run by then is refused
        shm=LIMITS,
    )
    daemon = start_daemon(config, workdir)
    count = 40  # tens of ms each: most are still queued at the signal
    try:
        with SharedRegion(4 * MIB, label="at-shutdown") as region, RawShm(shm_path(daemon)) as raw:
            registered = raw.call({"v": 1, "id": 1, "op": "register"}, [region.fd])
            assert registered["ok"] is True
            region_id = registered["result"]["region"]
            x = region.array(SLOW, np.float32)
            x[:] = 1.0
            ref = in_region("x", x, region_id, 0)
            out = in_region("y", x, region_id, 2 * MIB)
            for number in range(2, count + 2):
                header = {"v": 1, "id": number, "op": "infer", "model": "slow"}
                raw.socket.send(pack({**header, "inputs": [ref], "outputs": [out]}))
            wait_until(
                lambda: shm_status(daemon)["requests"] == count, message="every request read"
            )
            daemon.process.send_signal(signal.SIGTERM)
            codes: dict[int, str] = {}
            while reply_bytes := raw.socket.recv(MAX_SHM_MESSAGE_BYTES):  # b"": closed
                reply = protocol.unpack_header(reply_bytes)
                assert reply["id"] not in codes, reply  # answered once
                codes[reply["id"]] = "OK" if reply["ok"] else reply["error"]["code"]
        assert sorted(codes) == list(range(2, count + 2))
        assert set(codes.values()) <= {"OK", "UNAVAILABLE"}, codes
        assert "UNAVAILABLE" in codes.values()  # refused, not dropped, at shutdown
        assert daemon.process.wait(timeout=HANG_S) == 0, daemon.log()
        log = daemon.log()
        assert "requests_failed_at_shutdown" in log
        assert "shm_connection_closed" in log  # its region released with it
        assert "shm_region_still_viewed" not in log and "Traceback" not in log
        assert not (workdir / "run" / "shm.sock").exists()
    finally:
        if daemon.process.poll() is None:
            daemon.stop()


# -- zero copies inside the daemon ----------------------------------------------------


def rss_anon_kib(daemon: DaemonProcess) -> int:
    for line in Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon")


def test_large_tensors_in_a_region_cost_the_daemon_no_memory_of_their_size(
    daemon: DaemonProcess,
) -> None:
    batch = 42  # 25.3 MB a tensor
    shape = (batch, 3, 224, 224)
    nbytes = int(np.prod(shape)) * 4
    with InferenceClient(daemon.infer, timeout=30) as client:
        region = client.shared_region(2 * nbytes + MIB)
        x = region.array(shape, np.float32)
        x[:] = np.random.default_rng(1).random(shape, dtype=np.float32)
        y = region.array(shape, np.float32)
        before = rss_anon_kib(daemon)
        for _ in range(3):
            y[:] = 0
            client.infer("identity", {"input": x}, outputs={"output": y})
            assert np.array_equal(y, x)
        grown_kib = rss_anon_kib(daemon) - before
        assert grown_kib * 1024 < nbytes // 8, grown_kib
    # What the same measurement sees for the same request in frames: ONNX Runtime's
    # arena keeps an output-sized buffer (and ZeroMQ held both tensors meanwhile).
    with InferenceClient(daemon.infer, timeout=30) as client:
        before = rss_anon_kib(daemon)
        frames_x = np.ones(shape, np.float32)
        assert client.infer("identity", {"input": frames_x})["output"].shape == shape
        assert (rss_anon_kib(daemon) - before) * 1024 >= nbytes * 0.9


# -- inferctl -------------------------------------------------------------------------


#: ``inferctl(daemon, *args)`` on the daemon's infer and control sockets, each reply
#: awaited 10 s.
inferctl = functools.partial(shared_inferctl, cli_timeout=10, endpoints=("infer", "control"))


def test_inferctl_infer_shm_and_status_show_it(daemon: DaemonProcess) -> None:
    done = inferctl(daemon, "infer", "--model", "demo", "--random", "--shm", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["shm"] == {
        "socket": "shm",  # every tensor in a region: the request went on shm.sock
        "inputs_in_region": [DEMO_INPUT],
        "outputs_in_region": [DEMO_OUTPUT],
    }
    plain = json.loads(inferctl(daemon, "infer", "--model", "demo", "--random", "--json").stdout)
    assert summary["outputs"] == plain["outputs"]  # the same bytes either way
    with InferenceClient(daemon.infer, timeout=10) as client:
        client.shared_region(mmap.PAGESIZE, label="shown")
        status = inferctl(daemon, "status")
        assert status.returncode == 0, status.stderr
        (summary_line,) = [line for line in status.stdout.splitlines() if line.startswith("shm:")]
        assert f"(per uid {cli_format.size(LIMIT_BYTES)})" in summary_line
        (row,) = [line for line in status.stdout.splitlines() if " shown " in line]
        assert f"uid {os.getuid()} pid {os.getpid()}" in row and "registered" in row


def test_a_registration_that_timed_out_and_was_made_late_is_the_retrys(
    daemon: DaemonProcess,
) -> None:
    """The daemon, stopped, registers the region late, under an id the client never
    learnt.  The retry reads that late reply before it sends anything and takes it
    as the region's registration: the region is held once.  It is 5/8 of
    ``shm.max_bytes_per_uid``, so two copies do not fit (review RD: the retry was
    sent first and refused RESOURCE_EXHAUSTED for the bytes of its own late copy)."""
    nbytes = LIMIT_BYTES * 5 // 8

    def late(operator: OperatorClient) -> list[dict[str, Any]]:
        regions: list[dict[str, Any]] = operator.status()["shm"]["regions"]
        return [r for r in regions if r["label"] == "late" and r["state"] == "registered"]

    with (
        InferenceClient(daemon.infer, timeout=0.5) as client,
        OperatorClient(daemon.control, timeout=5) as operator,
    ):
        client.shared_region(4096)  # the registration connection is open
        with SharedRegion(nbytes, label="late") as region:
            with stopped(daemon.process.pid), pytest.raises(RequestTimeout):
                client.register_region(region)
            # The daemon goes on and makes it: its reply waits for the client.
            (made,) = wait_until(lambda: late(operator), message="the late registration")
            region_id = client.register_region(region)
            assert shown(region_id) == made["id"] and made["nbytes"] == nbytes
            assert [r["id"] for r in late(operator)] == [made["id"]]  # held once
            assert client.shm_regions["registered"] == 2
            client.unregister_region(region)
            # Released regions are listed ("releasing") until the registration
            # thread, woken by each release, has unmapped them.
            wait_until(
                lambda: all(
                    r["state"] == "registered" for r in operator.status()["shm"]["regions"]
                ),
                message="the released region unmapped",
            )
            held = [r["label"] for r in operator.status()["shm"]["regions"]]
            assert held == [None], held  # the first region only
