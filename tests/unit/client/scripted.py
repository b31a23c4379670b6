"""A scripted daemon for the client's unit tests: a ROUTER on its own thread that
answers each request as a test's script says (``server`` in ``conftest.py``), the
ok replies such a script sends, a script answering one result (``answering``), the
sockets on threads they run on (``socket_threads``), and ``top``'s screen as text."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import zmq
from rich.console import Console

from inferd_client.top import TopState, render

#: What the scripted ROUTER does with each request: its socket and the frames read.
Script = Callable[[zmq.Socket[Any], list[bytes]], None]


#: What a socket's thread runs (``socket_threads``): the bound socket, and the event
#: set when the test ends.
Loop = Callable[[zmq.Socket[Any], threading.Event], None]


@contextmanager
def socket_threads(
    tmp_path: Path, kind: int, name: str, join_s: float
) -> Iterator[Callable[[Loop], str]]:
    """``start(loop)``: the endpoint of a new socket of ``kind``, bound on its own
    ``ipc://`` path (``name`` and a number), that ``loop`` runs on its own thread until
    the block ends; the socket is closed once its loop returns, and each thread is
    joined (``join_s`` at most) as the block ends."""
    context = zmq.Context.instance()
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def start(loop: Loop) -> str:
        endpoint = f"ipc://{tmp_path}/{name}{len(threads)}.sock"
        sock = context.socket(kind)
        sock.bind(endpoint)

        def run() -> None:
            loop(sock, stop)
            sock.close(linger=0)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
        return endpoint

    try:
        yield start
    finally:
        stop.set()
        for thread in threads:
            thread.join(join_s)


def scripted_routers(tmp_path: Path) -> Iterator[Callable[[Script], str]]:
    """``start(script)``: the endpoint of a new ROUTER that runs ``script`` on each
    request until the test ends (each on its own ``ipc://`` path)."""

    def serving(script: Script) -> Loop:
        def loop(sock: zmq.Socket[Any], stop: threading.Event) -> None:
            while not stop.is_set():
                if sock.poll(50):
                    script(sock, sock.recv_multipart())

        return loop

    with socket_threads(tmp_path, zmq.ROUTER, "s", join_s=2) as start:
        yield lambda script: start(serving(script))


def ok_reply(
    request: dict[str, Any], outputs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The ok reply to ``request``: an infer reply (``outputs``, none by default),
    naming the model the request did (as the daemon's does: the client refuses
    another model's), or a control op's with a small result."""
    if request["op"] != "infer":
        return {"v": 1, "id": request["id"], "ok": True, "result": {"done": True}}
    return {
        "v": 1,
        "id": request["id"],
        "ok": True,
        "model": request.get("model", "m"),
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


def answering(result: dict[str, Any]) -> Script:
    """A script: every request answered ok with ``result``."""

    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        request = msgpack.unpackb(frames[1])
        reply = {"v": 1, "id": request["id"], "ok": True, "result": result}
        sock.send_multipart([frames[0], msgpack.packb(reply)])

    return script


def top_screen(state: TopState) -> str:
    """What ``inferctl top`` draws of ``state``, as plain text 160 columns wide."""
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(render(state, "ipc:///run/inferd/control.sock", 1.0, now=100.0))
    return console.file.getvalue()  # type: ignore[attr-defined]
