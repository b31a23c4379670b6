"""An exception between the parts of one message leaves the client in step (third
review of the Python client, finding 2).

Python runs signal handlers between bytecodes, so what one raises
(``KeyboardInterrupt``, a watchdog's exception) can land after the first part of
a reply was read: the rest stayed in the DEALER, and the next, undisturbed call
took a tensor frame for its header (``MalformedReply``).  The same on the events
socket (a payload read as an event of one frame), and on the send side: a request
sent half way was completed by the next request's parts, the daemon answered the
old id, and the next call timed out.

Each test makes the socket operation the client calls raise ``Interrupted`` right
after one part went through, as a handler would at that point; ``Interrupted`` is
a ``BaseException``, as ``KeyboardInterrupt`` is, but not one pytest stops on."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import EventSubscriber, InferenceClient
from tests.unit.client.scripted import Script, ok_reply

#: Outputs of every reply: several tensor frames after the header.
OUTPUTS = 3


class Interrupted(BaseException):
    """What a signal handler raised between two parts of one message."""


def echoing(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
    """A script: every infer answered with ``OUTPUTS`` float32 outputs holding the
    request's input value (so a reply shows which request it answers)."""
    request = msgpack.unpackb(frames[1])
    value = np.frombuffer(frames[2], np.float32)[0]
    outputs = [{"name": f"y{i}", "dtype": "float32", "shape": [1]} for i in range(OUTPUTS)]
    tensors = [np.array([value + i], np.float32).tobytes() for i in range(OUTPUTS)]
    sock.send_multipart([frames[0], msgpack.packb(ok_reply(request, outputs)), *tensors])


@pytest.fixture
def interrupt_after_part(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[zmq.Socket[Any], str], list[int]]:
    """``arm(sock, "recv" | "send")``: the next time ``sock`` receives (or sends) one
    part of a message with more parts to follow, that part goes through and
    ``Interrupted`` is raised, once; the count of those raised so far is returned."""
    real_recv = zmq.Socket.recv
    real_send = zmq.Socket.send
    raised = [0]
    armed: dict[str, zmq.Socket[Any] | None] = {"recv": None, "send": None}

    def recv(self: zmq.Socket[Any], *args: Any, **kwargs: Any) -> Any:
        part = real_recv(self, *args, **kwargs)
        if self is armed["recv"] and self.get(zmq.RCVMORE):
            armed["recv"] = None
            raised[0] += 1
            raise Interrupted("after a reply's first part")
        return part

    def send(self: zmq.Socket[Any], data: Any, flags: int = 0, *args: Any, **kwargs: Any) -> Any:
        sent = real_send(self, data, flags, *args, **kwargs)
        if self is armed["send"] and int(flags) & zmq.SNDMORE:
            armed["send"] = None
            raised[0] += 1
            raise Interrupted("after a request's first part")
        return sent

    monkeypatch.setattr(zmq.Socket, "recv", recv)
    monkeypatch.setattr(zmq.Socket, "send", send)

    def arm(sock: zmq.Socket[Any], operation: str) -> list[int]:
        armed[operation] = sock
        return raised

    return arm


def test_the_next_call_after_a_reply_read_half_way_gets_its_own_reply(
    server: Callable[[Script], str],
    interrupt_after_part: Callable[[zmq.Socket[Any], str], list[int]],
) -> None:
    with InferenceClient(server(echoing), timeout=5) as client:
        assert client.infer("m", {"x": np.array([1.0], np.float32)})["y0"][0] == 1.0
        raised = interrupt_after_part(client._channel._socket, "recv")
        with pytest.raises(Interrupted):
            client.infer("m", {"x": np.array([2.0], np.float32)})
        assert raised == [1]
        # Before: MalformedReply ("header is not valid msgpack"), a tensor frame of
        # the interrupted reply read as this reply's header.
        outputs = client.infer("m", {"x": np.array([3.0], np.float32)})
        assert {name: float(array[0]) for name, array in outputs.items()} == {
            "y0": 3.0,
            "y1": 4.0,
            "y2": 5.0,
        }
        assert client.infer("m", {"x": np.array([6.0], np.float32)})["y2"][0] == 8.0


def test_the_next_call_after_a_request_sent_half_way_gets_its_own_reply(
    server: Callable[[Script], str],
    interrupt_after_part: Callable[[zmq.Socket[Any], str], list[int]],
) -> None:
    with InferenceClient(server(echoing), timeout=2) as client:
        assert client.infer("m", {"x": np.array([1.0], np.float32)})["y0"][0] == 1.0
        raised = interrupt_after_part(client._channel._socket, "send")
        with pytest.raises(Interrupted):
            client.infer("m", {"x": np.array([2.0], np.float32)})
        assert raised == [1]
        # Before: RequestTimeout; the header of the interrupted request went out
        # with this request's parts, and the reply to its id was discarded.
        outputs = client.infer("m", {"x": np.array([3.0], np.float32)})
        assert float(outputs["y0"][0]) == 3.0
        assert client.discarded_replies == 0


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[str]:
    """The endpoint of a PUB that publishes ``health`` events (``seq`` counting up)
    every millisecond until the test ends."""
    endpoint = f"ipc://{tmp_path}/events.sock"
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUB)
    sock.bind(endpoint)
    stop = threading.Event()

    def publish() -> None:
        seq = 0
        while not stop.wait(0.001):  # the publisher's pace, not a synchronisation
            seq += 1
            sock.send_multipart([b"health", msgpack.packb({"state": "serving", "seq": seq})])

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    yield endpoint
    stop.set()
    thread.join(5)
    sock.close(linger=0)


def test_the_next_receive_after_an_event_read_half_way_gets_a_whole_event(
    publisher: str,
    interrupt_after_part: Callable[[zmq.Socket[Any], str], list[int]],
) -> None:
    with EventSubscriber(publisher, topics=["health"]) as subscriber:
        subscriber.wait_joined(5)
        first = subscriber.receive(5)
        assert first is not None
        raised = interrupt_after_part(subscriber._socket, "recv")
        with pytest.raises(Interrupted):
            subscriber.receive(5)
        assert raised == [1]
        # Before: MalformedReply ("event has 1 frames"), the payload left of the
        # interrupted event read as an event.
        event = subscriber.receive(5)
        assert event is not None
        topic, payload = event
        assert topic == "health" and payload["seq"] > first[1]["seq"]
