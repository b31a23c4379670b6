"""Memory bounds of a real daemon against clients that misbehave: one that
never reads its replies, one that sends a message of a million frames or too
many bytes, and queues that would hold too many bytes.  Memory is the daemon's
resident set (``/proc/<pid>/status``), compared against the configured bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import zmq
from onnx import TensorProto, helper, numpy_helper

from inferd.bus.reply_budget import RELEASE_GRACE_S
from inferd_client import ConnectionRefused, InferenceClient, OperatorClient
from inferd_wire.protocol import unpack_header
from tests.conftest import (
    HANG_S,
    DaemonFactory,
    DaemonProcess,
    memory_kib,
    wait_until,
    write_slow_loading_model,
)
from tests.integration.wire import IDENTITY_SHAPE, RawDealer, assert_error, pack

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
#: Float32 elements of the expand model's output: a 4 MiB reply to a 4-byte request.
EXPAND = MIB


def write_expand_model(path: Path, elements: int = EXPAND) -> Path:
    """``x`` f32[1] -> ``y`` f32[elements] (``x`` repeated): small requests, big replies."""
    shape = numpy_helper.from_array(np.array([elements], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["y"])],
        "expand",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [elements])],
        [shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def expand_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_expand_model(tmp_path_factory.mktemp("expand") / "expand.onnx")


@pytest.fixture(scope="module")
def slow_loading_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_slow_loading_model(tmp_path_factory.mktemp("slow") / "slow.onnx")


def reset_peak(daemon: DaemonProcess) -> None:
    """Start VmHWM (the peak resident set) again from the current resident set."""
    Path(f"/proc/{daemon.process.pid}/clear_refs").write_text("5")


def status(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=5) as operator:
        return operator.status()


def expand_request(request_id: Any) -> list[bytes]:
    header = {
        "v": 1,
        "id": request_id,
        "op": "infer",
        "model": "expand",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
    }
    return [pack(header), np.ones(1, np.float32).tobytes()]


def non_reader(endpoint: str) -> zmq.Socket[Any]:
    """A DEALER whose own queue holds one reply: what it does not read stays
    with the daemon."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def read_answers(sock: zmq.Socket[Any], count: int) -> dict[Any, dict[str, Any] | None]:
    """The first ``count`` answers on ``sock`` by request id: None for a reply
    with ``ok``, the ``error`` of one without."""
    answers: dict[Any, dict[str, Any] | None] = {}
    while len(answers) < count:
        assert sock.poll(HANG_S * 1000), f"{len(answers)} of {count} requests answered"
        header = unpack_header(sock.recv_multipart()[0])
        assert header["id"] not in answers, f"request {header['id']} answered twice"
        answers[header["id"]] = None if header["ok"] else header["error"]
    return answers


def replies_handled(daemon: DaemonProcess, count: int) -> dict[str, Any]:
    """The ``replies`` status once ``count`` infer replies were sent or dropped."""

    def handled() -> dict[str, Any] | None:
        replies = status(daemon)["bus"]["replies"]
        return replies if replies["sent"]["infer"] + replies["dropped"] >= count else None

    return wait_until(handled, 60, interval=0.05, message=f"{count} replies handled")


def test_a_client_that_never_reads_holds_at_most_its_budget_and_gives_it_back(
    daemon_factory: DaemonFactory, expand_model: Path
) -> None:
    per_peer = 64 * MIB
    requests = 150  # 600 MiB of replies per client if the daemon kept them all
    reply_bytes = EXPAND * 4 + 200
    daemon = daemon_factory(
        models=[{"name": "expand", "path": str(expand_model), "queue_capacity": 256}],
        bus={"max_reply_bytes_per_peer": per_peer, "max_reply_bytes_total": 2 * per_peer},
    )
    ones = {"x": np.ones(1, np.float32)}
    with InferenceClient(daemon.infer) as reader:
        for _ in range(5):  # warm up ONNX Runtime's and the allocator's arenas
            assert reader.infer("expand", ones)["y"].shape == (EXPAND,)
        base = memory_kib(daemon)
        reset_peak(daemon)
        handled = 5
        # Two clients in turn: the second reuses what the first one's backlog held.
        for client in range(2):
            sock = non_reader(daemon.infer)
            for request_id in range(requests):
                sock.send_multipart(expand_request(request_id))
            handled += requests
            replies = replies_handled(daemon, handled)
            # The daemon keeps at most its budget for the peer and drops the rest:
            # the peer's own socket and the connection hold only a couple.
            assert replies["in_flight_bytes"] <= per_peer
            assert len(replies["dropping_peers"]) == client + 1
            peer = replies["dropping_peers"][0]
            assert peer["socket"] == "infer" and peer["in_flight_bytes"] > per_peer - reply_bytes
            assert peer["dropped"] >= requests - per_peer // reply_bytes - 4, replies
            grown_mib = (memory_kib(daemon) - base) / 1024
            peak_mib = (memory_kib(daemon, "VmHWM") - base) / 1024
            assert grown_mib < per_peer / MIB + 48, f"RSS grew {grown_mib:.0f} MiB"
            assert peak_mib < per_peer / MIB + 64, f"peak RSS grew {peak_mib:.0f} MiB"
            # Other clients are served meanwhile, and lose nothing.
            assert reader.infer("expand", ones)["y"].shape == (EXPAND,)
            handled += 1
            if client == 0:
                # Should it read after all, each request has one answer: its reply,
                # or in place of a dropped one a notice it can act on.
                answers = read_answers(sock, requests)
                assert sorted(answers) == list(range(requests))
                notices = [a for a in answers.values() if a is not None]
                assert len(notices) == peer["dropped"]
                assert all(a["code"] == "RESOURCE_EXHAUSTED" for a in notices)
                assert "of this client's earlier replies not yet read" in notices[0]["message"]
            sock.close(linger=0)  # the client leaves: its backlog is freed
            wait_until(
                lambda: status(daemon)["bus"]["replies"]["in_flight_bytes"] == 0,
                message="the backlog released",
            )
        replies = status(daemon)["bus"]["replies"]
        assert replies["dropped"] == sum(peer["dropped"] for peer in replies["dropping_peers"])
        # Each client's first refusal waited a release grace that ran out; the
        # refusals after it, in the same episode, waited none (DESIGN.md 284).
        graces = replies["graces"]
        assert 2 <= graces["ran_out"] <= graces["waited"], graces
        assert graces["waited_s"] >= graces["ran_out"] * RELEASE_GRACE_S, graces
        # The requests were answered (and counted); only their delivery was dropped.
        model = next(m for m in status(daemon)["models"] if m["model"] == "expand")
        assert model["responses"] == {"OK": handled}
    assert daemon.log().count("replies_dropped_peer_not_reading") == 2, "once per peer"


def identity_header(request_id: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "id": request_id,
        "op": "infer",
        "model": "identity",
        "inputs": [{"name": "input", "dtype": "float32", "shape": list(IDENTITY_SHAPE)}],
    }


def test_a_message_of_a_million_frames_is_refused_without_being_held(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    frames = 1_000_000
    daemon = daemon_factory(models=[{"name": "identity", "path": str(identity_model)}])
    base = memory_kib(daemon)
    reset_peak(daemon)
    with RawDealer(daemon.infer) as dealer:
        sock = dealer.socket
        sock.send(pack(identity_header("many")), zmq.SNDMORE)
        for _ in range(frames - 1):
            sock.send(b"", zmq.SNDMORE)
        sock.send(b"")
        reply, _ = dealer.recv(timeout=60)
        assert_error(
            reply,
            "INVALID_ARGUMENT",
            f"message carries {frames} tensor frames; the limit is 64",
            "many",
        )
        # The connection goes on serving: the rest of the message was read to its end.
        frame = np.zeros(IDENTITY_SHAPE, np.float32)
        ok, _ = dealer.request([pack(identity_header("next")), frame.tobytes()])
        assert ok["ok"] is True and ok["id"] == "next"
    # ZeroMQ itself holds the whole message before the daemon sees a frame (a
    # 64-byte message struct per frame: ~61 MiB here); the daemon adds nothing
    # per frame (it held ~570 bytes a frame, frame objects and buffer views).
    peak_mib = (memory_kib(daemon, "VmHWM") - base) / 1024
    assert peak_mib < 160, f"peak RSS grew {peak_mib:.0f} MiB"
    bus = status(daemon)["bus"]
    assert (bus["oversized_messages"], bus["oversized_bytes"]) == (1, 0)
    wait_until(
        lambda: memory_kib(daemon) - base < 24 * 1024,
        message=f"RSS back within 24 MiB of {base} KiB",
    )


def test_tensor_bytes_over_the_limit_are_let_go_and_counted(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    daemon = daemon_factory(
        models=[{"name": "identity", "path": str(identity_model)}],
        bus={"max_message_bytes": 1_000_000},
    )
    chunk = bytes(512 * 1024)  # each frame under ZMQ_MAXMSGSIZE
    with RawDealer(daemon.infer) as dealer:
        reply, _ = dealer.request([pack(identity_header("big")), *([chunk] * 40)], timeout=30)
        assert_error(
            reply,
            "INVALID_ARGUMENT",
            f"tensor frames hold {40 * len(chunk)} bytes; the limit is 1000000",
            "big",
        )
        frame = np.zeros(IDENTITY_SHAPE, np.float32).tobytes()
        ok, _ = dealer.request([pack(identity_header("next")), frame])
    assert ok["ok"] is True and ok["id"] == "next"
    bus = status(daemon)["bus"]
    assert (bus["oversized_messages"], bus["oversized_bytes"]) == (1, 40 * len(chunk))
    assert bus["malformed"] == 1


def test_one_frame_over_the_limit_is_answered_not_a_dropped_connection(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    """ZeroMQ closes the connection of a peer whose frame exceeds ``MAXMSGSIZE``
    (no reply: the client would only time out), so the per-frame guard sits at twice
    ``max_message_bytes``: a single tensor over the limit gets its error."""
    daemon = daemon_factory(
        models=[{"name": "identity", "path": str(identity_model)}],
        bus={"max_message_bytes": 1_000_000},
    )
    with RawDealer(daemon.infer) as dealer:
        reply, _ = dealer.request([pack(identity_header("one")), bytes(1_500_000)], timeout=30)
    assert_error(
        reply, "INVALID_ARGUMENT", "tensor frames hold 1500000 bytes; the limit is 1000000", "one"
    )


def slow_request(request_id: int, elements: int = 4) -> list[bytes]:
    header = {
        "v": 1,
        "id": request_id,
        "op": "infer",
        "model": "slow",
        "inputs": [{"name": "x", "dtype": "float32", "shape": [elements]}],
    }
    return [pack(header), np.ones(elements, np.float32).tobytes()]


def test_queued_bytes_per_model_are_bounded(
    daemon_factory: DaemonFactory, slow_loading_model: Path
) -> None:
    # While the model loads nothing leaves its queue: 16-byte requests, room for two.
    daemon = daemon_factory(
        models=[{"name": "slow", "path": str(slow_loading_model), "queue_max_bytes": 40}],
        wait_ready=False,
    )
    with RawDealer(daemon.infer) as dealer:
        for request_id in (1, 2, 3):
            dealer.send(slow_request(request_id))
        refused, _ = dealer.recv(timeout=10)
        assert_error(
            refused,
            "RESOURCE_EXHAUSTED",
            "queue of model 'slow' holds 32 bytes; this request's 16 would exceed its limit "
            "of 40 bytes (queue_max_bytes)",
            3,
        )
        model = next(m for m in status(daemon)["models"] if m["model"] == "slow")
        assert model["state"] == "loading", "the model loaded before the test could queue"
        assert (model["queue_depth"], model["queue_bytes"], model["queue_max_bytes"]) == (2, 32, 40)
        too_big, _ = dealer.request(slow_request(4, elements=20))
        assert_error(
            too_big,
            "INVALID_ARGUMENT",
            "request holds 80 tensor bytes; model 'slow' queues at most 40 bytes",
            4,
        )
        served = sorted(dealer.recv(timeout=30)[0]["id"] for _ in range(2))
    assert served == [1, 2]
    model = next(m for m in status(daemon)["models"] if m["model"] == "slow")
    assert (model["queue_depth"], model["queue_bytes"]) == (0, 0)
    assert model["responses"] == {"OK": 2, "RESOURCE_EXHAUSTED": 1, "INVALID_ARGUMENT": 1}


def test_connections_over_max_connections_are_refused_and_a_closed_one_makes_room(
    daemon_factory: DaemonFactory, identity_model: Path
) -> None:
    """``bus.max_connections`` (DESIGN.md 128) on a real daemon's infer socket: two
    clients are served, a third's handshake is refused (counted, nothing held for
    it), and once one of the two leaves a new client is served."""
    daemon = daemon_factory(
        models=[{"name": "identity", "path": str(identity_model)}], bus={"max_connections": 2}
    )
    x = np.zeros(IDENTITY_SHAPE, np.float32)

    def infer_socket() -> dict[str, Any]:
        with OperatorClient(daemon.control, timeout=5) as operator:
            return dict(operator.status()["security"]["sockets"]["infer"])

    served = [InferenceClient(daemon.infer, timeout=10) for _ in range(2)]
    try:
        for client in served:
            client.infer("identity", {"input": x})
        refused = InferenceClient(daemon.infer, timeout=1)
        with pytest.raises(ConnectionRefused):  # at once, not a timeout
            refused.infer("identity", {"input": x})
        refused.close()
        wait_until(lambda: infer_socket()["connections"] == 2, message="two connections held")
        assert infer_socket()["connections_refused"] >= 1
        with OperatorClient(daemon.control, timeout=5) as operator:
            assert operator.status()["security"]["max_connections"] == 2
        served.pop().close()
        wait_until(lambda: infer_socket()["connections"] == 1, message="the closed one let go")
        with InferenceClient(daemon.infer, timeout=10) as newcomer:
            assert newcomer.infer("identity", {"input": x})["output"].shape == IDENTITY_SHAPE
    finally:
        for client in served:
            client.close()
    assert "over bus.max_connections (2)" in daemon.log()
