"""``outputs=`` arrays that cannot take an output (second review of the Python
client): an array for an output the model does not have was left as it was, as if
written, where a region's is refused by the daemon; a value that is no numpy array
raised ``AttributeError``; a read-only array was refused only after the request ran;
a big-endian array in a region was filled with byte-swapped values."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from inferd_client import InferenceClient, InvalidArgument, SharedRegion
from inferd_client.shm import placed_outputs
from tests.unit.client.scripted import ok_reply


class EchoRouter:
    """A ROUTER that answers every infer request with one output ``y``, its input's
    frame, and counts the requests it got."""

    def __init__(self, endpoint: str) -> None:
        self.requests = 0
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                routing, header, frame = self._sock.recv_multipart()
                request = msgpack.unpackb(header)
                self.requests += 1
                (described,) = request["inputs"]
                reply = ok_reply(request, outputs=[{**described, "name": "y"}])
                self._sock.send_multipart([routing, msgpack.packb(reply), frame])
        self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


@pytest.fixture
def echo(tmp_path: Path) -> Iterator[tuple[str, EchoRouter]]:
    endpoint = f"ipc://{tmp_path}/infer.sock"
    router = EchoRouter(endpoint)
    yield endpoint, router
    router.close()


def test_an_array_for_an_output_the_model_does_not_have_is_refused_and_none_written(
    echo: tuple[str, EchoRouter],
) -> None:
    endpoint, _ = echo
    x = np.arange(4, dtype=np.float32)
    with InferenceClient(endpoint, timeout=5) as client:
        assert np.array_equal(client.infer("m", {"x": x})["y"], x)
        typo, y = np.zeros(4, np.float32), np.zeros(4, np.float32)
        for _ in range(2):  # the first reply parsed, then the same call's kept parsing
            with pytest.raises(InvalidArgument, match=r"\['yy'\].*\['y'\]"):
                client.infer("m", {"x": x}, outputs={"y": y, "yy": typo})
            assert not typo.any() and not y.any()  # nothing written, not even y
        assert client.infer("m", {"x": x}, outputs={"y": y})["y"] is y
        assert np.array_equal(y, x)


@pytest.mark.parametrize(
    "value", [[0.0, 0.0, 0.0, 0.0], memoryview(bytearray(16)).cast("f")], ids=["list", "memoryview"]
)
def test_an_output_value_that_is_no_numpy_array_is_an_invalid_argument(
    echo: tuple[str, EchoRouter], value: Any
) -> None:
    endpoint, router = echo
    with (
        InferenceClient(endpoint, timeout=5) as client,
        pytest.raises(InvalidArgument, match="not a numpy array"),
    ):
        client.infer("m", {"x": np.zeros(4, np.float32)}, outputs={"y": value})
    assert router.requests == 0


def test_a_read_only_output_array_is_refused_before_anything_is_sent(
    echo: tuple[str, EchoRouter],
) -> None:
    endpoint, router = echo
    y = np.zeros(4, np.float32)
    y.flags.writeable = False
    with (
        InferenceClient(endpoint, timeout=5) as client,
        pytest.raises(InvalidArgument, match="read-only"),
    ):
        client.infer("m", {"x": np.ones(4, np.float32)}, outputs={"y": y})
    assert router.requests == 0 and not y.any()


def test_a_big_endian_array_in_a_region_is_refused_as_an_output() -> None:
    """The daemon writes little-endian bytes: a ``>f4`` array placed in a region read
    3.0 as 2.3e-41 (a big-endian input was refused already, a frame target too)."""
    with SharedRegion(4096) as region:
        y = region.array((4,), ">f4")
        with pytest.raises(InvalidArgument, match="big-endian"):
            placed_outputs({"y": y}, {"ab" * 16: region})
        little = region.array((4,), "<f4")
        (placed,) = placed_outputs({"y": little}, {"ab" * 16: region})
        assert placed["dtype"] == "float32"
        del y, little
