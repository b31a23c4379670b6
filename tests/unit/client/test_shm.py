"""The client's side of shared-memory tensors (``inferd_client.shm``): sealed regions,
arrays in them, and how a request and its reply describe them."""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd_client.client import infer_request_header
from inferd_client.errors import ClientError, InvalidArgument, MalformedReply, RequestTimeout
from inferd_client.outputs import decode_outputs
from inferd_client.region import SharedRegion
from inferd_client.shm import (
    RegionChannel,
    SameCall,
    ShmRequest,
    encode_inputs,
    layout_of,
    placed_outputs,
)
from inferd_wire import protocol
from inferd_wire.protocol import Code
from inferd_wire.regions import MAX_SHM_MESSAGE_BYTES
from tests.conftest import HANG_S, transparent_huge_pages, vm_flags

ID = "ab" * 16


def test_a_region_is_a_sealed_page_multiple_memfd() -> None:
    with SharedRegion(1000, label="cam") as region:
        assert region.nbytes == mmap.PAGESIZE
        seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        assert os.readlink(f"/proc/self/fd/{region.fd}").startswith("/memfd:inferd-cam")
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, 0)


@pytest.mark.skipif(not transparent_huge_pages(), reason="a kernel without huge pages")
def test_a_region_asks_for_transparent_huge_pages() -> None:
    with SharedRegion(4 * 1024 * 1024, label="huge") as region:
        assert "hg" in vm_flags(region.address)  # MADV_HUGEPAGE


def test_arrays_are_aligned_and_located() -> None:
    with SharedRegion(3 * mmap.PAGESIZE) as region:
        a = region.array(3, np.uint8)
        b = region.array((2, 4), np.float32)
        assert region.locate(a) == (0, 3) and region.locate(b) == (256, 32)
        b[:] = 1.0
        assert region.locate(b[:, :2]) is None  # not contiguous: sent as a frame
        assert region.locate(np.zeros(4)) is None
        with pytest.raises(ClientError, match="bytes left"):
            region.array(3 * mmap.PAGESIZE, np.uint8)
        region.reset()
        assert region.locate(region.array(1, np.uint8)) == (0, 1)


def test_requests_describe_region_arrays_and_frame_the_rest() -> None:
    with SharedRegion(mmap.PAGESIZE) as region:
        regions = {ID: region}
        x = region.array((2, 2), np.float32)
        z = np.ones(3, np.int64)
        descriptors, frames = encode_inputs({"x": x, "z": z}, regions)
        assert descriptors == [
            {
                "name": "x",
                "dtype": "float32",
                "shape": [2, 2],
                "region": ID,
                "offset": 0,
                "nbytes": 16,
            },
            {"name": "z", "dtype": "int64", "shape": [3]},
        ]
        assert len(frames) == 1 and frames[0] is z
        y = region.array(4, np.float32)
        elsewhere = np.zeros(2, np.float32)
        placed = placed_outputs({"y": y, "w": elsewhere}, regions)
        assert placed == [
            {
                "name": "y",
                "dtype": "float32",
                "shape": [4],
                "region": ID,
                "offset": 256,
                "nbytes": 16,
            }
        ]


class Frame:
    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


def test_replies_return_the_callers_arrays() -> None:
    placed = {"name": "y", "dtype": "float32", "shape": [2], "region": ID, "offset": 0, "nbytes": 8}
    y = np.zeros(2, np.float32)
    w = np.zeros(2, np.float32)
    reply: dict[str, Any] = {
        "outputs": [
            placed,
            {"name": "w", "dtype": "float32", "shape": [2]},
            {"name": "v", "dtype": "int8", "shape": [1]},
        ]
    }
    frames = [Frame(np.array([1, 2], np.float32).tobytes()), Frame(b"\x07")]
    outputs = decode_outputs(reply, frames, {"y": y, "w": w}, [placed])  # type: ignore[arg-type]
    assert outputs["y"] is y and outputs["w"] is w and w.tolist() == [1.0, 2.0]
    assert outputs["v"].tolist() == [7]
    with pytest.raises(MalformedReply, match="not asked"):
        decode_outputs(reply, frames, {"y": y}, [])  # type: ignore[arg-type]
    with pytest.raises(MalformedReply, match="carries 1 frames"):
        decode_outputs(reply, frames[:1], {"y": y}, [placed])  # type: ignore[arg-type]
    with pytest.raises(ClientError, match="the array given for it"):
        decode_outputs(reply, frames, {"y": y, "w": np.zeros(3, np.float32)}, [placed])  # type: ignore[arg-type]


@pytest.mark.parametrize("written", [{"dtype": "int32"}, {"shape": [1, 2]}])
def test_an_output_written_as_another_dtype_or_shape_than_placed_is_malformed(
    written: dict[str, Any],
) -> None:
    """The same bytes, where they were asked, but not what the caller's array reads."""
    placed = {"name": "y", "dtype": "float32", "shape": [2], "region": ID, "offset": 0, "nbytes": 8}
    reply = {"outputs": [{**placed, **written}]}
    with pytest.raises(MalformedReply, match="it was placed as"):
        decode_outputs(reply, [], {"y": np.zeros(2, np.float32)}, [placed])


@pytest.mark.parametrize("written", [{"offset": False}, {"shape": [2.0]}, {"nbytes": 8.0}])
def test_a_shm_reply_equal_to_its_placements_only_by_python_equality_is_not_taken_as_them(
    written: dict[str, Any],
) -> None:
    placed = {"name": "y", "dtype": "float32", "shape": [2], "region": ID, "offset": 0, "nbytes": 8}
    request = ShmRequest({"op": "infer"}, [placed])
    assert request.written_as_placed([dict(placed)])
    assert not request.written_as_placed([{**placed, **written}])


def test_a_prepared_shm_request_encodes_exactly_the_header_with_its_id_last() -> None:
    with SharedRegion(4 * mmap.PAGESIZE) as region:
        x, y = region.array((2, 8), np.float32), region.array((2, 8), np.float32)
        descriptors, frames = encode_inputs({"x": x}, {ID: region})
        placed = placed_outputs({"y": y}, {ID: region})
        assert frames == []
        for deadline_ms in (None, 25):
            header = infer_request_header("m", descriptors, placed, deadline_ms)
            prepared = ShmRequest(header, placed, [region])
            for request_id in (1, 2**40 + 7, 2**64 - 1):
                expected = protocol.pack({**header, "id": request_id})
                assert prepared.encode(request_id) == expected
        assert prepared.valid
        del x, y
    assert not prepared.valid  # its region is closed: the client encodes afresh
    with pytest.raises(ValueError, match="without its id"):
        ShmRequest({"id": 1}, [])


def test_the_layout_of_arrays_tells_apart_what_the_encoding_depends_on() -> None:
    with SharedRegion(4 * mmap.PAGESIZE) as region:
        a = region.array((4, 4), np.float32)
        assert layout_of({"a": a}) == layout_of({"a": a})
        assert layout_of({"a": a}) != layout_of({"b": a})  # the name
        assert layout_of({"a": a}) != layout_of({"a": a.T})  # the strides
        assert layout_of({"a": a}) != layout_of({"a": a.reshape(16)})  # the shape
        assert layout_of({"a": a}) != layout_of({"a": a.view(np.int32)})  # the dtype
        assert layout_of({"a": a}) != layout_of({"a": a[1:]})  # the address
        assert layout_of({"a": [1.0, 2.0]}) is None  # not an array: not cached
        del a


def test_a_call_with_the_very_same_arrays_is_seen_at_once_and_nothing_else_is() -> None:
    with SharedRegion(4 * mmap.PAGESIZE) as region:
        x, y = region.array((4, 4), np.float32), region.array((4, 4), np.float32)
        placed = placed_outputs({"y": y}, {ID: region})
        request = ShmRequest(infer_request_header("m", [], placed, None), placed, [region])
        call = SameCall("m", None, {"x": x}, {"y": y}, request)
        assert call.matches("m", None, {"x": x}, {"y": y})
        assert not call.matches("other", None, {"x": x}, {"y": y})  # the model
        assert not call.matches("m", 25, {"x": x}, {"y": y})  # the deadline
        assert not call.matches("m", None, {"z": x}, {"y": y})  # a name
        assert not call.matches("m", None, {"x": x, "y": y}, {})  # inputs and outputs
        assert not call.matches("m", None, {"x": x[:]}, {"y": y})  # another array object
        assert not call.matches("m", None, {"x": [1.0]}, {"y": y})  # not an array
        x.shape = (16,)  # the caller reshapes its own array in place
        assert not call.matches("m", None, {"x": x}, {"y": y})
        x.shape = (4, 4)
        assert call.matches("m", None, {"x": x}, {"y": y})
        del x, y
    assert not request.valid  # its region is closed
    with SharedRegion(4 * mmap.PAGESIZE) as region:
        z = region.array((4, 4), np.float32)
        assert not call.matches("m", None, {"x": z}, {"y": z})  # the arrays it held are gone
        del z


class SilentShmSocket:
    """A ``shm.sock`` listener (a real ``SOCK_SEQPACKET`` socket) that accepts one
    connection, reads what it is sent and answers only when told to."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(1)
        self.peer: socket.socket | None = None

    def received(self) -> dict[str, Any]:
        if self.peer is None:
            self.peer, _ = self.listener.accept()
            self.peer.settimeout(HANG_S)
        return protocol.unpack_header(self.peer.recv(MAX_SHM_MESSAGE_BYTES), 1 << 16)

    def answer(self, request_id: int) -> None:
        assert self.peer is not None
        self.peer.send(protocol.pack({"v": 1, "id": request_id, "ok": True, "outputs": []}))

    def close(self) -> None:
        for sock in (self.peer, self.listener):
            if sock is not None:
                sock.close()


def test_a_request_times_out_and_late_replies_are_discarded(tmp_path: Path) -> None:
    server = SilentShmSocket(str(tmp_path / "shm.sock"))
    ids = iter(range(1, 100))
    channel = RegionChannel(str(tmp_path / "shm.sock"), timeout=HANG_S, next_id=lambda: next(ids))
    request = ShmRequest({"v": 1, "op": "infer", "model": "m", "inputs": []}, [])
    try:
        started = time.monotonic()
        with pytest.raises(RequestTimeout, match="after 2 attempt"):
            channel.request(request, timeout=0.2, retries=1)
        assert 0.4 <= time.monotonic() - started < HANG_S  # two waits of 0.2 s
        assert [server.received()["id"], server.received()["id"]] == [1, 2]
        # The late replies come in before the next one; each is counted, none returned.
        server.answer(1)
        server.answer(2)
        server.answer(3)
        assert channel.request(request, timeout=HANG_S)["id"] == 3
        assert server.received()["id"] == 3
        assert channel.discarded_replies == 2
    finally:
        channel.close()
        server.close()


def test_signals_do_not_stretch_a_requests_timeout(tmp_path: Path) -> None:
    """A wait is measured against a deadline: a signal that interrupts it every 50
    ms (a timer in the calling program) does not start it again (as SO_RCVTIMEO
    would, each time Python retries the call)."""
    server = SilentShmSocket(str(tmp_path / "shm.sock"))
    channel = RegionChannel(str(tmp_path / "shm.sock"), timeout=HANG_S)
    request = ShmRequest({"v": 1, "op": "infer", "model": "m", "inputs": []}, [])
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, _frame: interrupted.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    try:
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            channel.request(request, timeout=0.3)
        assert time.monotonic() - started < HANG_S / 2
        assert len(interrupted) >= 3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
        channel.close()
        server.close()


def test_a_null_id_refusal_is_the_waiting_requests_answer_never_a_late_one(
    tmp_path: Path,
) -> None:
    """Every message the channel sends is one the daemon reads whole and answers
    under its id, so an error without an id (a refusal at connect, a header over
    the daemon's ``bus.max_header_bytes``) answers the request that waits now.
    Taken for the late answer of one that had timed out, it was discarded and the
    request waiting timed out instead of failing."""
    server = SilentShmSocket(str(tmp_path / "shm.sock"))
    ids = iter(range(1, 100))
    channel = RegionChannel(str(tmp_path / "shm.sock"), timeout=HANG_S, next_id=lambda: next(ids))
    request = ShmRequest({"v": 1, "op": "infer", "model": "m", "inputs": []}, [])
    try:
        with pytest.raises(RequestTimeout):
            channel.request(request, timeout=0.1)
        assert server.received()["id"] == 1
        assert server.peer is not None
        server.peer.send(protocol.pack(protocol.error_header(None, Code.INVALID_ARGUMENT, "x")))
        reply = channel.request(request, timeout=HANG_S)
        assert reply["id"] is None and reply["error"]["message"] == "x"
        assert server.received()["id"] == 2
        # The late answers come next: each discarded, none taken for the next one's.
        server.answer(1)
        server.answer(2)
        server.answer(3)
        assert channel.request(request, timeout=HANG_S)["id"] == 3
        assert server.received()["id"] == 3 and channel.discarded_replies == 2
    finally:
        channel.close()
        server.close()


def test_a_request_over_the_shm_sockets_bound_fails_at_once_and_is_never_sent(
    tmp_path: Path,
) -> None:
    """The daemon refuses a message over ``MAX_SHM_MESSAGE_BYTES`` without an id (it
    reads no more of it): after a request had timed out, that refusal was taken
    for the late answer of the one that timed out, and the call timed out too."""
    server = SilentShmSocket(str(tmp_path / "shm.sock"))
    ids = iter(range(1, 100))
    channel = RegionChannel(str(tmp_path / "shm.sock"), timeout=HANG_S, next_id=lambda: next(ids))
    small = ShmRequest({"v": 1, "op": "infer", "model": "m", "inputs": []}, [])
    large = ShmRequest({"v": 1, "op": "infer", "model": "m" * MAX_SHM_MESSAGE_BYTES}, [])
    try:
        with pytest.raises(RequestTimeout):
            channel.request(small, timeout=0.1)
        assert server.received()["id"] == 1
        with pytest.raises(InvalidArgument, match=f"at most {MAX_SHM_MESSAGE_BYTES} bytes"):
            channel.request(large, timeout=HANG_S)
        server.answer(3)
        assert channel.request(small, timeout=HANG_S)["id"] == 3
        assert server.received()["id"] == 3  # the large one never went
    finally:
        channel.close()
        server.close()


def test_registrations_and_requests_on_the_shm_socket_take_ids_from_one_counter(
    tmp_path: Path,
) -> None:
    """The client hands its channel its one counter (its infer socket's too): a
    registration numbered 1, 2, ... beside requests numbered by the client could
    share an id with one, and a late reply to one be taken for the other's."""
    server = SilentShmSocket(str(tmp_path / "shm.sock"))
    ids = iter(range(7 << 40, (7 << 40) + 100))
    channel = RegionChannel(str(tmp_path / "shm.sock"), timeout=0.1, next_id=lambda: next(ids))
    request = ShmRequest({"v": 1, "op": "infer", "model": "m", "inputs": []}, [])
    try:
        with SharedRegion(mmap.PAGESIZE) as region, pytest.raises(RequestTimeout):
            channel.register(region)
        with pytest.raises(RequestTimeout):
            channel.request(request)
        assert [server.received()["id"], server.received()["id"]] == [7 << 40, (7 << 40) + 1]
    finally:
        channel.close()
        server.close()
