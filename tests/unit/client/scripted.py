"""A scripted daemon for the client's unit tests: a ROUTER on its own thread that
answers each request as a test's script says (``server`` in ``conftest.py``), and
the ok replies such a script sends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import zmq

#: What the scripted ROUTER does with each request: its socket and the frames read.
Script = Callable[[zmq.Socket[Any], list[bytes]], None]


def scripted_routers(tmp_path: Path) -> Iterator[Callable[[Script], str]]:
    """``start(script)``: the endpoint of a new ROUTER that runs ``script`` on each
    request until the test ends (each on its own ``ipc://`` path)."""
    context = zmq.Context.instance()
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(script: Script) -> str:
        endpoint = f"ipc://{tmp_path}/s{len(threads)}.sock"
        sock = context.socket(zmq.ROUTER)
        sock.bind(endpoint)

        def loop() -> None:
            while not stop.is_set():
                if sock.poll(50):
                    script(sock, sock.recv_multipart())
            sock.close(linger=0)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        threads.append(thread)
        return endpoint

    yield start
    stop.set()
    for thread in threads:
        thread.join(2)


def ok_reply(
    request: dict[str, Any], outputs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The ok reply to ``request``: an infer reply (``outputs``, none by default),
    or a control op's with a small result."""
    if request["op"] != "infer":
        return {"v": 1, "id": request["id"], "ok": True, "result": {"done": True}}
    return {
        "v": 1,
        "id": request["id"],
        "ok": True,
        "model": "m",
        "runtime": "onnx_trt_ep",
        "fallback": False,
        "latency_us": 1,
        "queue_us": 1,
        "late": False,
        "outputs": outputs or [],
        "thermal": "unknown",
    }


def answer_ok(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
    """A script: every request answered ok, with no outputs."""
    sock.send_multipart([frames[0], msgpack.packb(ok_reply(msgpack.unpackb(frames[1])))])
