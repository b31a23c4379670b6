"""Client request/reply correlation against a scripted ROUTER peer."""

from __future__ import annotations

import gc
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import (
    EventSubscriber,
    InferenceClient,
    OperatorClient,
    RemoteError,
    RequestTimeout,
)
from inferd_client import client as client_module
from inferd_client.client import infer_request_header
from inferd_client.errors import ClientError, InvalidArgument, MalformedReply, Unreachable
from inferd_client.outputs import decode_outputs
from inferd_wire import protocol
from tests.unit.client.scripted import Loop, Script, socket_threads


def reply_to(frames: list[bytes], request_id: Any, *tensors: np.ndarray) -> list[bytes]:
    outputs = [
        {"name": f"out{i}", "dtype": t.dtype.name, "shape": list(t.shape)}
        for i, t in enumerate(tensors)
    ]
    header = {
        "v": 1,
        "id": request_id,
        "ok": True,
        "model": "m",
        "runtime": "onnx_trt_ep",
        "fallback": False,
        "latency_us": 10,
        "queue_us": 1,
        "late": False,
        "outputs": outputs,
        "thermal": "unknown",
    }
    return [frames[0], msgpack.packb(header), *(t.tobytes() for t in tensors)]


def test_late_reply_to_an_old_id_is_discarded_not_returned(server: Callable[[Script], str]) -> None:
    seen: list[int] = []

    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        request_id = msgpack.unpackb(frames[1])["id"]
        seen.append(request_id)
        if len(seen) == 1:
            return  # first attempt: stay silent until the client retries
        # Answer the stale id first, then the live one with different data.
        sock.send_multipart(reply_to(frames, seen[0], np.full(2, 1.0, np.float32)))
        sock.send_multipart(reply_to(frames, request_id, np.full(2, 2.0, np.float32)))

    endpoint = server(script)
    with InferenceClient(endpoint, timeout=0.3, retries=1) as client:
        outputs = client.infer("m", {"x": np.zeros(2, np.float32)})
        assert seen[0] != seen[1]
        np.testing.assert_array_equal(outputs["out0"], [2.0, 2.0])
        assert client.discarded_replies == 1


def test_timeout_without_retries_raises(server: Callable[[Script], str]) -> None:
    endpoint = server(lambda sock, frames: None)
    with InferenceClient(endpoint, timeout=0.1) as client:
        started = time.monotonic()
        with pytest.raises(RequestTimeout, match="1 attempt"):
            client.infer("m", {"x": np.zeros(2, np.float32)})
        assert time.monotonic() - started < 1.0


def test_each_call_waits_its_own_timeout_never_less(server: Callable[[Script], str]) -> None:
    # The client waits on the socket's descriptor for the time left of each call:
    # a short wait after a long one, and a long one after it, each last at least
    # what was asked.
    answered = threading.Event()

    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        if answered.is_set():
            request_id = msgpack.unpackb(frames[1])["id"]
            sock.send_multipart(reply_to(frames, request_id, np.ones(2, np.float32)))

    endpoint = server(script)
    with InferenceClient(endpoint, timeout=0.4) as client:
        for wait in (0.4, 0.1, 0.3):
            started = time.monotonic()
            with pytest.raises(RequestTimeout):
                client.infer("m", {"x": np.zeros(2, np.float32)}, timeout=wait)
            elapsed = time.monotonic() - started
            assert wait <= elapsed < wait + 0.25, (wait, elapsed)
        answered.set()
        outputs = client.infer("m", {"x": np.zeros(2, np.float32)})
        np.testing.assert_array_equal(outputs["out0"], [1.0, 1.0])


def test_a_receive_timeout_that_ends_early_is_waited_out(
    server: Callable[[Script], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wait can end before the caller's deadline (libzmq's clock lagged by a
    millisecond under ``ZMQ_RCVTIMEO``; now any event of the socket ends a
    ``poll(2)``): the client measures the time left again and waits on, never
    returning early."""
    from inferd_client.channel import SocketWait

    calls: list[float] = []

    def ends_at_once(self: SocketWait, timeout_ms: int) -> None:
        calls.append(time.monotonic())

    endpoint = server(lambda sock, frames: None)
    with InferenceClient(endpoint, timeout=1) as client:
        monkeypatch.setattr(SocketWait, "poll", ends_at_once)
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            client.infer("m", {"x": np.zeros(2, np.float32)}, timeout=0.05)
        assert time.monotonic() - started >= 0.05
        assert len(calls) > 1  # it went back to wait


def test_error_replies_raise_remote_error_with_code(server: Callable[[Script], str]) -> None:
    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        request_id = msgpack.unpackb(frames[1])["id"]
        error = {"code": "NOT_FOUND", "message": "no model named 'm'"}
        sock.send_multipart(
            [frames[0], msgpack.packb({"v": 1, "id": request_id, "ok": False, "error": error})]
        )

    with InferenceClient(server(script), timeout=1) as client, pytest.raises(RemoteError) as caught:
        client.infer("m", {"x": np.zeros(2, np.float32)})
    assert caught.value.code == "NOT_FOUND"


def test_reply_frames_must_match_descriptors() -> None:
    class Frame:
        def __init__(self, data: bytes) -> None:
            self.buffer = memoryview(data)

    header = {"outputs": [{"name": "y", "dtype": "float32", "shape": [2]}]}
    with pytest.raises(MalformedReply, match="carries 0 frames"):
        decode_outputs(header, [])
    with pytest.raises(MalformedReply, match="needs 8"):
        decode_outputs(header, [Frame(b"1234")])  # type: ignore[list-item]


@pytest.fixture
def publisher(tmp_path: Any) -> Iterator[Callable[[bool], str]]:
    """A PUB socket in a thread: ``build`` events numbered 0, 1, 2, ... and, when asked,
    a ``health`` event after each, until the test ends."""

    def publishing(with_health: bool) -> Loop:
        def loop(sock: zmq.Socket[Any], stop: threading.Event) -> None:
            seq = 0
            while not stop.wait(0.002):  # the publishing pace, not a synchronisation
                sock.send_multipart([b"build", msgpack.packb({"seq": seq})])
                if with_health:
                    sock.send_multipart([b"health", msgpack.packb({"ok": True})])
                seq += 1

        return loop

    with socket_threads(tmp_path, zmq.PUB, "events", join_s=5) as start:
        yield lambda with_health: start(publishing(with_health))


def test_a_joined_subscriber_misses_nothing_and_hides_the_health_it_used(
    publisher: Callable[[bool], str],
) -> None:
    with EventSubscriber(publisher(True), topics=["build"]) as subscriber:
        subscriber.wait_joined(timeout=5)
        received = [subscriber.receive(timeout=5) for _ in range(50)]
    assert all(event is not None and event[0] == "build" for event in received)
    seqs = [event[1]["seq"] for event in received if event is not None]
    assert seqs == list(range(seqs[0], seqs[0] + 50))  # in order, none lost


def test_health_stays_visible_when_it_was_asked_for(publisher: Callable[[bool], str]) -> None:
    with EventSubscriber(publisher(True), topics=["build", "health"]) as subscriber:
        subscriber.wait_joined(timeout=5)
        topics = {event[0] for event in (subscriber.receive(timeout=5) for _ in range(10)) if event}
    assert topics == {"build", "health"}


@pytest.mark.parametrize("topic", ["he", "h", ""])
def test_health_stays_visible_when_a_prefix_of_it_or_every_topic_was_asked_for(
    publisher: Callable[[bool], str], topic: str
) -> None:
    with EventSubscriber(publisher(True), topics=[topic]) as subscriber:
        subscriber.wait_joined(timeout=5)
        topics = {event[0] for event in (subscriber.receive(timeout=5) for _ in range(10)) if event}
    assert "health" in topics


def test_joining_a_daemon_that_publishes_no_health_is_an_error(
    publisher: Callable[[bool], str],
) -> None:
    with (
        EventSubscriber(publisher(False), topics=["build"]) as subscriber,
        pytest.raises(Unreachable, match=r"no health event .* within 0\.2 s"),
    ):
        subscriber.wait_joined(timeout=0.2)


def echo_inputs(headers: list[bytes]) -> Script:
    """A server that answers each infer request with its own tensors, each input
    ``name`` as output ``name``, and keeps every header frame it received."""

    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        headers.append(frames[1])
        request = msgpack.unpackb(frames[1])
        answer = reply_to(frames, request["id"])
        header = msgpack.unpackb(answer[1])
        header["outputs"] = request["inputs"]
        sock.send_multipart([frames[0], msgpack.packb(header), *frames[2:]])

    return script


def test_a_camera_loop_over_frames_sends_the_full_encoding_each_time(
    server: Callable[[Script], str],
) -> None:
    """Calls with arrays of the same names, dtypes and shapes reuse one prepared
    header (DESIGN.md 115): the daemon gets the bytes the full encoding gives,
    each with its own id, and each reply's tensors come back."""
    headers: list[bytes] = []
    with InferenceClient(server(echo_inputs(headers)), timeout=5) as client:
        for value in range(5):
            x = np.full((2, 3), float(value), np.float32)
            outputs = client.infer("m", {"x": x}, deadline_ms=40)
            np.testing.assert_array_equal(outputs["x"], x)
        assert len(client._frames_requests) == 1
        ids = [msgpack.unpackb(header)["id"] for header in headers]
        assert len(set(ids)) == 5
        descriptor = {"name": "x", "dtype": "float32", "shape": [2, 3]}
        for header, request_id in zip(headers, ids, strict=True):
            expected = infer_request_header("m", [descriptor], [], 40)
            assert header == protocol.pack({**expected, "id": request_id})
        # Another shape is another header, and its reply's new outputs are parsed.
        y = np.arange(8, dtype=np.int32).reshape(2, 2, 2)
        outputs = client.infer("m", {"x": y}, deadline_ms=40)
        assert outputs["x"].shape == (2, 2, 2) and outputs["x"].dtype == np.int32
        np.testing.assert_array_equal(outputs["x"], y)
        assert len(client._frames_requests) == 2


def test_the_prepared_frames_requests_are_bounded(server: Callable[[Script], str]) -> None:
    """A caller cycling through many shapes makes the client keep at most
    ``_MAX_PREPARED_REQUESTS`` headers; past the bound it starts again, and
    every call is still answered with its own tensors."""
    headers: list[bytes] = []
    bound = client_module._MAX_PREPARED_REQUESTS
    with InferenceClient(server(echo_inputs(headers)), timeout=5) as client:
        for length in range(1, bound + 3):
            x = np.arange(length, dtype=np.float32)
            np.testing.assert_array_equal(client.infer("m", {"x": x})["x"], x)
            assert len(client._frames_requests) <= bound
        assert len(client._frames_requests) == 2  # cleared when full, then two more
        assert len(headers) == bound + 2


def test_arrays_the_wire_cannot_take_as_they_are_are_encoded_afresh(
    server: Callable[[Script], str],
) -> None:
    headers: list[bytes] = []
    with InferenceClient(server(echo_inputs(headers)), timeout=5) as client:
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        for array in (x.T, x.T.astype(">f4"), x.T.tolist()):
            outputs = client.infer("m", {"x": array})
            np.testing.assert_array_equal(outputs["x"], x.T)
            assert outputs["x"].dtype == np.float32 or isinstance(array, list)
        assert client._frames_requests == {}  # none was prepared
        assert len(headers) == 3


def test_a_malformed_reply_after_good_ones_is_refused(server: Callable[[Script], str]) -> None:
    """A reply's outputs parsed for the last reply are reused only when they are the
    same; every frame's length is checked against its shape, every time."""
    short = threading.Event()

    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        request_id = msgpack.unpackb(frames[1])["id"]
        parts = reply_to(frames, request_id, np.ones(4, np.float32))
        if short.is_set():
            parts[-1] = parts[-1][:8]
        sock.send_multipart(parts)

    with InferenceClient(server(script), timeout=5) as client:
        x = np.zeros(2, np.float32)
        for _ in range(3):
            np.testing.assert_array_equal(client.infer("m", {"x": x})["out0"], np.ones(4))
        short.set()
        with pytest.raises(MalformedReply, match="frame holds 8 bytes"):
            client.infer("m", {"x": x})
        short.clear()
        np.testing.assert_array_equal(client.infer("m", {"x": x})["out0"], np.ones(4))


def test_a_calls_timeout_bounds_its_send_when_no_daemon_is_there(tmp_path: Path) -> None:
    """The send waits at most the call's own time left, not the constructor's timeout,
    also once ZeroMQ's queue for the endpoint would be full (SNDHWM 1000)."""
    with InferenceClient(f"ipc://{tmp_path}/infer.sock", timeout=3.0) as client:
        for _ in range(1000):
            with pytest.raises(RequestTimeout):
                client.describe(timeout=0.001)
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            client.describe(timeout=0.05)
        assert time.monotonic() - started < 1.0


def test_a_request_that_timed_out_with_no_daemon_there_is_never_delivered(
    tmp_path: Path,
) -> None:
    """ZMQ_IMMEDIATE: nothing is queued for a connection that is not up, so requests
    given up on are not run all at once when a daemon appears."""
    endpoint = f"ipc://{tmp_path}/control.sock"
    with OperatorClient(endpoint, timeout=0.001) as operator:
        for _ in range(20):
            with pytest.raises(RequestTimeout):
                operator.call("stale")
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.bind(endpoint)
        received: list[str] = []

        def answer_the_first() -> None:
            if router.poll(5000):
                frames = router.recv_multipart()
                request = msgpack.unpackb(frames[1])
                received.append(request["op"])
                reply = {"v": 1, "id": request["id"], "ok": True, "result": {}}
                router.send_multipart([frames[0], msgpack.packb(reply)])

        answering = threading.Thread(target=answer_the_first)
        answering.start()
        try:
            # Waits for the connection, then for the answer: only "fresh" was sent.
            assert operator.call("fresh", timeout=5) == {}
            answering.join()
            assert received == ["fresh"]
            assert not router.poll(0)
        finally:
            answering.join()
            router.close(linger=0)


def test_an_unsendable_dtype_is_an_invalid_argument_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    with InferenceClient(f"ipc://{tmp_path}/infer.sock", timeout=0.5) as client:
        with pytest.raises(InvalidArgument, match="not sendable"):
            client.infer("m", {"x": np.zeros(4, np.uint32)})
        with pytest.raises(InvalidArgument, match="not sendable"):
            client.infer("m", {"x": np.zeros(4, np.uint32)[::2]})  # not prepared either


@pytest.mark.parametrize("endpoint", ["tcp://localhost", "tcp://127.0.0.1:notaport"])
@pytest.mark.parametrize("connector", [InferenceClient, OperatorClient, EventSubscriber])
def test_a_malformed_endpoint_is_an_invalid_argument_naming_it_and_leaks_no_socket(
    endpoint: str, connector: Callable[[str], Any]
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InvalidArgument, match=re.escape(endpoint)):
            connector(endpoint)
        gc.collect()
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == [], [str(w.message) for w in unclosed]


def test_a_closed_client_raises_a_client_error(tmp_path: Path) -> None:
    client = InferenceClient(f"ipc://{tmp_path}/infer.sock", timeout=0.5)
    client.close()
    with pytest.raises(ClientError, match="closed"):
        client.infer("m", {"x": np.zeros(2, np.float32)})


def test_an_output_array_that_cannot_take_its_output_leaves_every_array_unwritten() -> None:
    reply = {
        "outputs": [
            {"name": "a", "dtype": "float32", "shape": [2]},
            {"name": "b", "dtype": "float32", "shape": [2]},
        ]
    }
    frames = [zmq.Frame(np.ones(2, np.float32).tobytes()) for _ in range(2)]
    a, read_only = np.zeros(2, np.float32), np.zeros(2, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        decode_outputs(reply, frames, {"a": a, "b": read_only})
    with pytest.raises(InvalidArgument, match="given for it is"):
        decode_outputs(reply, frames, {"a": a, "b": np.zeros(3)})
    np.testing.assert_array_equal(a, [0, 0])


def test_a_reply_with_a_float_shape_is_refused_after_good_replies_too(
    server: Callable[[Script], str],
) -> None:
    floats = threading.Event()

    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        parts = reply_to(frames, msgpack.unpackb(frames[1])["id"], np.ones(4, np.float32))
        if floats.is_set():
            header = msgpack.unpackb(parts[1])
            header["outputs"][0]["shape"] = [4.0]
            parts[1] = msgpack.packb(header)
        sock.send_multipart(parts)

    with InferenceClient(server(script), timeout=5) as client:
        x = np.zeros(2, np.float32)
        for good in (False, True):
            if good:
                floats.clear()
                client.infer("m", {"x": x})
            floats.set()
            with pytest.raises(MalformedReply, match="non-negative integers"):
                client.infer("m", {"x": x})
