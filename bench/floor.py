"""The least any Python daemon could add to a round trip, beside what inferd adds.

``rtt.py``'s targets compare the daemon with ONNX Runtime in process.  This
bench measures the floor under that comparison on the machine it runs on: a
*bare server* in its own process that does only what cannot be left out.  It
reads one message from a ``SOCK_SEQPACKET`` socket, runs the same model with an
``IOBinding`` on the same memfd region (the client's ``SharedRegion``), and
sends a reply header of the daemon's size.  It has no decoding, checks,
scheduler, accounting or logging; its client sends prepared bytes and reads
the reply without looking at it.

Where the two processes run decides what a round trip costs: a wake-up on the
waker's own CPU is a context switch, one on another CPU an inter-processor
interrupt, which a VM pays dearly.  So the timing thread is pinned to one CPU
and the bare server runs twice, on that CPU and on another one.  Four paths
per case, timed in one run, interleaved in blocks like ``rtt.py``:

``inprocess``    ``InferenceSession.run`` in this process (``rtt.py``'s baseline).
``floor1cpu``    the bare server on the timing thread's CPU.
``floor2cpu``    the bare server on another CPU.
``shm``          ``InferenceClient.infer`` against an ``inferd run`` subprocess,
                 input and output in a registered region (``rtt.py``'s ``shm``);
                 the daemon's threads go where the kernel puts them.

The same for today's protocol, tensors in ZeroMQ frames: a *bare frames
server* (a pyzmq ROUTER that runs ``session.run`` on each request's tensor
frame and sends the output back zero-copy, with a reply header of the
daemon's size; no pinning, like the daemon) against the daemon and
``rtt.py``'s echo of the same bytes:

``echo``         ``rtt.py``'s bare pyzmq echo of the frames request.
``echobuf``      the same echo with both ends' connection given the kernel send
                 buffer inferd gives its own (``SendBuffer``, 2 MiB; DESIGN.md 116).
``framesfloor``  the bare frames server, sent the frames request's bytes, its
                 connection sized like ``echobuf``'s.
``frames``       ``InferenceClient.infer`` with the tensor in a frame (``rtt.py``'s ``frames``).

A floor path minus ``inprocess`` is what the transport, two process wake-ups
and a minimal Python loop on each side cost here.  ``shm`` minus a floor is
what inferd itself adds: its checks, admission, scheduling, accounting and
client library.  A target of ``rtt.py`` that even ``floor1cpu`` misses cannot
be met by a Python daemon on this machine.

``--json`` prints rows ``{"case", "path", "median_us", "p99_us", "n"}`` with
``path`` one of ``PATHS``.  Needs two CPUs.

Run from the repository root: ``.venv/bin/python bench/floor.py [--iterations N] [--json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402

from inferd_client import InferenceClient, SharedRegion  # noqa: E402
from inferd_wire import protocol  # noqa: E402
from inferd_wire.endpoints import DEFAULT_SEND_BUFFER_BYTES  # noqa: E402
from inferd_wire.send_buffer import SendBuffer  # noqa: E402
from rtt import (  # noqa: E402
    CASES,
    EchoClient,
    add_run_options,
    bench_daemon,
    bench_scratch,
    frames_request,
    run_and_report,
    session_for,
    start_frames_echo,
    summarize,
    time_interleaved,
)

PATHS = ("inprocess", "floor1cpu", "floor2cpu", "shm", "echo", "echobuf", "framesfloor", "frames")
#: The bare server's request buffer: a request header is far smaller.
_RECEIVE_BYTES = 4096


# -- the bare server (runs in its own process) -----------------------------------
def bare_server(spec: dict[str, Any]) -> None:
    """Answer every message on ``spec["sock"]`` with one run of the model bound to
    the region ``spec["region"]`` and a reply of ``spec["reply_bytes"]``."""
    import onnxruntime as ort

    os.sched_setaffinity(0, {spec["cpu"]})
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = spec["threads"]
    session = ort.InferenceSession(
        spec["model"], sess_options=options, providers=["CPUExecutionProvider"]
    )
    mapping = mmap.mmap(spec["region"], spec["nbytes"], mmap.MAP_SHARED)
    base = np.frombuffer(mapping, np.uint8)
    binding = session.io_binding()
    for bind, (name, offset, shape) in (
        (binding.bind_input, spec["input"]),
        (binding.bind_output, spec["output"]),
    ):
        bind(name, "cpu", 0, np.float32, shape, base[offset:].ctypes.data)
    reply = b"r" * spec["reply_bytes"]
    sock = socket.socket(fileno=spec["sock"])
    gc.disable()  # as in rtt.py's echo server: a pause here is no one's cost
    print("ready", flush=True)
    while True:
        if not sock.recv(_RECEIVE_BYTES):
            return
        session.run_with_iobinding(binding)
        sock.send(reply)


def bare_frames_server(spec: dict[str, Any]) -> None:
    """Answer every message on the ROUTER bound at ``spec["endpoint"]`` (``[id,
    header, tensor]``) with ``[id, reply header, output]``: one ``session.run`` of
    the tensor frame, the output sent zero-copy, as the daemon sends it."""
    import onnxruntime as ort
    import zmq

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = spec["threads"]
    session = ort.InferenceSession(
        spec["model"], sess_options=options, providers=["CPUExecutionProvider"]
    )
    name, shape = spec["input"], spec["shape"]
    reply_header = b"r" * spec["reply_bytes"]
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    send_buffer = SendBuffer(spec["endpoint"], DEFAULT_SEND_BUFFER_BYTES)  # as the daemon's
    send_buffer.watch(sock)
    sock.bind(spec["endpoint"])
    gc.disable()  # as in rtt.py's echo server
    print("ready", flush=True)
    while True:
        routing_id, _header, tensor = sock.recv_multipart(copy=False)
        send_buffer.apply()
        x = np.frombuffer(tensor.buffer, np.float32).reshape(shape)
        (output,) = session.run(None, {name: x})
        sock.send_multipart([routing_id, reply_header, output], copy=False)


def start_bare_server(spec: dict[str, Any], pass_fds: tuple[int, ...]) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--bare-server", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=pass_fds,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError("the bare server did not start")
    return process


class BareClient:
    """Sends one prepared message and waits for the reply (blocking)."""

    def __init__(self, sock: socket.socket, message: bytes) -> None:
        self._socket = sock
        self._message = message

    def round_trip(self) -> None:
        self._socket.send(self._message)
        self._socket.recv(_RECEIVE_BYTES)

    def close(self) -> None:
        self._socket.close()


# -- measurement -----------------------------------------------------------------
def offset_of(region: SharedRegion, array: np.ndarray) -> int:
    located = region.locate(array)
    assert located is not None  # made by region.array
    return located[0]


def run(iterations: int, block: int, warmup: int, threads: int) -> dict[str, Any]:
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        raise SystemExit("floor.py needs two CPUs: it times a wake-up on another CPU too")
    here, elsewhere = sorted(cpus)[:2]
    with bench_scratch("ifd-f-") as scratch:
        workdir = scratch.workdir
        with bench_daemon(workdir, threads) as daemon:
            client = InferenceClient(daemon.infer, timeout=60.0)
            scratch.closers.append(client.close)
            rng = np.random.default_rng(20261203)
            calls: dict[tuple[str, str], Callable[[], object]] = {}
            counts: dict[tuple[str, str], int] = {}
            for case in CASES:
                model_path = workdir / "models" / f"{case.model}.onnx"
                session = session_for(workdir, case.model, threads)
                (output_meta,) = session.get_outputs()
                x = rng.random(case.input_shape, dtype=np.float32)
                feeds = {case.input_name: x}
                (output,) = client.infer(case.model, feeds).values()

                region = client.shared_region(x.nbytes + output.nbytes + 4096, label=case.name)
                shared_in = region.array(x.shape, np.float32)
                shared_in[...] = x
                shared_out = region.array(output.shape, np.float32)
                inputs, outputs = {case.input_name: shared_in}, {output_meta.name: shared_out}
                client.infer(case.model, inputs, outputs=outputs)  # learns the shm path
                reply_bytes = len(protocol.pack(client.last_reply))

                # Frames: rtt.py's echo and request bytes, and the bare frames server.
                (frame_output,) = client.infer(case.model, feeds).values()
                frames_reply = protocol.pack(client.last_reply)
                request_parts = frames_request(case.model, feeds)
                echo = start_frames_echo(
                    scratch, case.name, request_parts, frames_reply, frame_output.nbytes
                )
                echobuf = start_frames_echo(
                    scratch,
                    f"{case.name}-buf",
                    request_parts,
                    frames_reply,
                    frame_output.nbytes,
                    DEFAULT_SEND_BUFFER_BYTES,
                )
                frames_endpoint = f"ipc://{workdir}/bare-{case.name}.sock"
                frames_server = start_bare_server(
                    {
                        "model": str(model_path),
                        "threads": threads,
                        "endpoint": frames_endpoint,
                        "input": case.input_name,
                        "shape": list(x.shape),
                        "reply_bytes": len(frames_reply),
                    },
                    (),
                )
                scratch.processes.append(frames_server)
                frames_floor = EchoClient(frames_endpoint, request_parts, DEFAULT_SEND_BUFFER_BYTES)
                scratch.closers.append(frames_floor.close)

                # The daemon's request for these arrays, as its client encodes it.
                request = protocol.pack(
                    {
                        "v": protocol.PROTOCOL_VERSION,
                        "op": "infer",
                        "model": case.model,
                        "inputs": [{"name": case.input_name, "region": "r" * 22}],
                        "outputs": [{"name": output_meta.name, "region": "r" * 22}],
                        "id": 2**63 + 1,
                    }
                )
                floors: dict[str, BareClient] = {}
                for path, cpu in (("floor1cpu", here), ("floor2cpu", elsewhere)):
                    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    spec = {
                        "model": str(model_path),
                        "threads": threads,
                        "cpu": cpu,
                        "sock": theirs.fileno(),
                        "region": region.fd,
                        "nbytes": region.nbytes,
                        "input": [case.input_name, offset_of(region, shared_in), list(x.shape)],
                        "output": [
                            output_meta.name,
                            offset_of(region, shared_out),
                            list(output.shape),
                        ],
                        "reply_bytes": reply_bytes,
                    }
                    process = start_bare_server(spec, (theirs.fileno(), region.fd))
                    scratch.processes.append(process)
                    theirs.close()
                    floors[path] = BareClient(ours, request)
                    scratch.closers.append(floors[path].close)

                def via_shm(
                    model: str = case.model,
                    inputs: dict[str, Any] = inputs,
                    outputs: dict[str, Any] = outputs,
                ) -> object:
                    return client.infer(model, inputs, outputs=outputs)

                def via_frames(model: str = case.model, feeds: dict[str, Any] = feeds) -> object:
                    return client.infer(model, feeds)

                def in_process(
                    session: Any = session,
                    names: list[str] = [output_meta.name],  # noqa: B006
                    feeds: dict[str, np.ndarray] = feeds,
                ) -> object:
                    return session.run(names, feeds)

                for path, call in (
                    ("inprocess", in_process),
                    ("floor1cpu", floors["floor1cpu"].round_trip),
                    ("floor2cpu", floors["floor2cpu"].round_trip),
                    ("shm", via_shm),
                    ("echo", echo.round_trip),
                    ("echobuf", echobuf.round_trip),
                    ("framesfloor", frames_floor.round_trip),
                    ("frames", via_frames),
                ):
                    calls[(case.name, path)] = call
                    counts[(case.name, path)] = max(10, int(iterations * case.share))

            # Only this thread: the daemon, the bare servers and ZeroMQ's threads
            # were started before and keep every CPU.
            os.sched_setaffinity(0, {here})
            try:
                samples = time_interleaved(calls, counts, iterations, block, warmup)
            finally:
                os.sched_setaffinity(0, cpus)
            scratch.close_clients()
    rows = [summarize(case, path, samples[(case, path)]) for case, path in samples]
    return {"rows": rows, "load_average": os.getloadavg(), "iterations": iterations}


def print_table(result: dict[str, Any]) -> None:
    medians = {(row["case"], row["path"]): row["median_us"] for row in result["rows"]}
    cases = list(dict.fromkeys(row["case"] for row in result["rows"]))
    header = (
        f"{'case':<15} {'inprocess':>10} {'floor1cpu':>10} {'floor2cpu':>10} {'shm':>9} "
        f"{'floor1_x':>9} {'floor2_x':>9} {'shm_x':>6} {'floor1_add':>11} {'floor2_add':>11} "
        f"{'shm_add':>8}"
    )
    print("shared memory, medians (us); _x = path / inprocess; _add = path - inprocess")
    print(header)
    print("-" * len(header))
    for case in cases:
        inprocess, one, two, shm = (
            medians[(case, path)] for path in ("inprocess", "floor1cpu", "floor2cpu", "shm")
        )
        print(
            f"{case:<15} {inprocess:>10.1f} {one:>10.1f} {two:>10.1f} {shm:>9.1f} "
            f"{one / inprocess:>9.2f} {two / inprocess:>9.2f} {shm / inprocess:>6.2f} "
            f"{one - inprocess:>11.1f} {two - inprocess:>11.1f} {shm - inprocess:>8.1f}"
        )
    header = (
        f"{'case':<15} {'inprocess':>10} {'echo':>9} {'echobuf':>9} {'framesfloor':>12} "
        f"{'frames':>9} {'floor_add':>10} {'frames_add':>11} {'floor/echo':>11} "
        f"{'frames/echo':>12} {'floor/echobuf':>14} {'frames/echobuf':>15}"
    )
    print(
        "\nframes, medians (us); _add = path - inprocess; x/echo = x_add over the echo "
        "(x/echobuf: over the echo with inferd's send buffers)"
    )
    print(header)
    print("-" * len(header))
    for case in cases:
        inprocess, echo, echobuf, floor, frames = (
            medians[(case, path)]
            for path in ("inprocess", "echo", "echobuf", "framesfloor", "frames")
        )
        floor_add, frames_add = floor - inprocess, frames - inprocess
        print(
            f"{case:<15} {inprocess:>10.1f} {echo:>9.1f} {echobuf:>9.1f} {floor:>12.1f} "
            f"{frames:>9.1f} {floor_add:>10.1f} {frames_add:>11.1f} {floor_add / echo:>11.2f} "
            f"{frames_add / echo:>12.2f} {floor_add / echobuf:>14.2f} {frames_add / echobuf:>15.2f}"
        )
    load = ", ".join(f"{value:.2f}" for value in result["load_average"])
    print(
        f"\n{result['iterations']} iterations per path (identity-6MB x0.5, -25MB x0.25), "
        f"interleaved in blocks, timed on one CPU; load average at the end {load} on "
        f"{os.cpu_count()} CPUs."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser)
    parser.add_argument("--bare-server", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server:
        spec = json.loads(args.bare_server)
        (bare_frames_server if "endpoint" in spec else bare_server)(spec)
        return 0
    return run_and_report(parser, args, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
