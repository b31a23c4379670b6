"""A reply frame over the client's bound is refused by libzmq as its length
arrives (``ZMQ_MAXMSGSIZE``), not taken whole into memory first; the call that
waited for it fails at once with ``ConnectionLost`` instead of waiting out its
timeout (libzmq never connects again after that protocol error), and the next
call on the same client is answered: the client connected again itself.  The
control socket's bound is a header's (a control reply carries no tensor frame);
the infer socket's is ``InferenceClient(max_reply_frame_bytes=...)``, None by
default (no bound).  A daemon that goes away while a request waits fails it at
once too; one that restarted while the client was idle fails nothing."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd_client import (
    ConnectionLost,
    InferenceClient,
    InvalidArgument,
    OperatorClient,
    RequestTimeout,
)
from inferd_wire import protocol
from inferd_wire.curve import ClientCurve
from tests.conftest import HANG_S
from tests.unit.client.scripted import ok_reply

_OVERSIZED_BYTES = 64 << 20
#: The most the peak RSS may grow while a 64 MiB frame is refused (it grew by
#: the frame, 64 MiB, when libzmq took it whole).
_RSS_GROWTH_BOUND = 16 << 20
_CLEAR_REFS = Path("/proc/self/clear_refs")


class Daemon:
    """A ROUTER on its own thread playing the daemon: each request (routing id,
    header) is handed to the next of ``answers``, which replies on ``sock`` (or
    calls ``restart``).  Each incarnation has its own context, ended before the
    next binds: the old socket's file is then gone before the new one is made.
    ``handshakes`` gets one item for each connection a client completes."""

    def __init__(
        self,
        endpoint: str,
        answers: Sequence[Callable[[Daemon, bytes, dict[str, Any]], None]],
        curve_secret_key: bytes | None = None,
        max_message_size: int = -1,
    ) -> None:
        self.endpoint = endpoint
        self._max_message_size = max_message_size
        self.requests = 0
        self.handshakes: queue.Queue[None] = queue.Queue()
        self._answers = iter(answers)
        self._restart = threading.Event()
        self._stop = threading.Event()
        self._curve_secret_key = curve_secret_key
        self._open()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @classmethod
    def over_curve(
        cls, answers: Sequence[Callable[[Daemon, bytes, dict[str, Any]], None]]
    ) -> tuple[Daemon, ClientCurve]:
        """A daemon on ``tcp://127.0.0.1`` with CURVE, and a client's keys for it."""
        public, secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        daemon = cls("tcp://127.0.0.1:*", answers, curve_secret_key=secret)
        return daemon, ClientCurve(public.decode(), client_public.decode(), client_secret.decode())

    def _open(self) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self.sock = self._context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_size)
        if self._curve_secret_key is not None:
            self.sock.curve_server = True
            self.sock.curve_secretkey = self._curve_secret_key
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.bind(self.endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def restart(self) -> None:
        """Close the socket, dropping its connections, and bind a new one (on the
        daemon's thread: from an answer, or ``restart_when_idle``)."""
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._context.term()  # the old socket's file is unlinked before the new bind
        self._open()

    def restart_when_idle(self) -> None:
        self._restart.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._restart.is_set():
                self._restart.clear()
                self.restart()
            while self._monitor.poll(0):
                parse_monitor_message(self._monitor.recv_multipart())
                self.handshakes.put(None)
            if self.sock.poll(20):
                routing, header, *_ = self.sock.recv_multipart()
                self.requests += 1
                next(self._answers)(self, routing, msgpack.unpackb(header))
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._context.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(HANG_S)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    made: list[Daemon] = []

    def make(*answers: Callable[[Daemon, bytes, dict[str, Any]], None]) -> Daemon:
        made.append(Daemon(f"ipc://{tmp_path}/d{len(made)}.sock", answers))
        return made[-1]

    yield make
    for daemon in made:
        daemon.close()


def answer_ok(daemon: Daemon, routing: bytes, request: dict[str, Any]) -> None:
    daemon.sock.send_multipart([routing, msgpack.packb(ok_reply(request))])


def answer_with_tensor(tensor: bytes) -> Callable[[Daemon, bytes, dict[str, Any]], None]:
    """An infer reply with one ``uint8`` output ``y``, ``tensor``, sent zero-copy
    (the daemon's side adds nothing to the process's RSS)."""

    def answer(daemon: Daemon, routing: bytes, request: dict[str, Any]) -> None:
        output = {"name": "y", "dtype": "uint8", "shape": [len(tensor)]}
        header = msgpack.packb(ok_reply(request, [output]))
        daemon.sock.send_multipart([routing, header, tensor], copy=False)

    return answer


def answer_with_header(frame: bytes) -> Callable[[Daemon, bytes, dict[str, Any]], None]:
    def answer(daemon: Daemon, routing: bytes, request: dict[str, Any]) -> None:
        daemon.sock.send_multipart([routing, frame], copy=False)

    return answer


def go_away(daemon: Daemon, routing: bytes, request: dict[str, Any]) -> None:
    daemon.restart()


def _peak_rss_growth(call: Callable[[], object]) -> int:
    """How much the process's peak RSS grew during ``call`` (bytes): the peak is
    reset to the current RSS first (``/proc/self/clear_refs``)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError as exc:
        pytest.skip(f"the peak RSS cannot be reset here: {exc}")
    before = _vm_hwm()
    call()
    return _vm_hwm() - before


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _raises_connection_lost(call: Callable[[], object]) -> Callable[[], str]:
    def run() -> str:
        with pytest.raises(ConnectionLost) as caught:
            call()
        return str(caught.value)

    return run


def _header_of_exactly(request_id: int, nbytes: int) -> bytes:
    """An ok control reply of exactly ``nbytes`` (a bin16 pad, whatever its length)."""
    reply = {"v": 1, "id": request_id, "ok": True, "result": {"pad": b"\x00" * 256}}
    reply["result"]["pad"] = b"\x00" * (nbytes - len(msgpack.packb(reply)) + 256)
    frame: bytes = msgpack.packb(reply)
    assert len(frame) == nbytes
    return frame


def test_a_control_reply_over_a_headers_bound_fails_at_once_unread_and_the_next_is_answered(
    daemons: Callable[..., Daemon],
) -> None:
    oversized = b"\x01" * _OVERSIZED_BYTES  # resident before the measurement

    def largest(daemon: Daemon, routing: bytes, request: dict[str, Any]) -> None:
        frame = _header_of_exactly(request["id"], protocol.MAX_HEADER_BYTES)
        daemon.sock.send_multipart([routing, frame])

    daemon = daemons(largest, answer_with_header(oversized), answer_ok)
    with OperatorClient(daemon.endpoint, timeout=HANG_S) as client:
        assert len(client.call("status")["pad"]) > 65000  # a header of the bound arrives
        message = ""

        def refused() -> None:
            nonlocal message
            message = _raises_connection_lost(lambda: client.call("status"))()

        growth = _peak_rss_growth(refused)
        # Without ZMQ_MAXMSGSIZE the 64 MiB frame was taken whole (the peak grew by
        # it) and then refused as a MalformedReply.
        assert growth < _RSS_GROWTH_BOUND, f"the peak RSS grew {growth / 2**20:.1f} MiB"
        assert "ended while request" in message and "65536 bytes" in message
        assert client.call("status") == {"done": True}  # connected again
        assert client.connections_lost == 1
    assert daemon.requests == 3


def test_an_infer_reply_frame_over_max_reply_frame_bytes_fails_at_once_unread(
    daemons: Callable[..., Daemon],
) -> None:
    bound = 1 << 20
    oversized = b"\x01" * _OVERSIZED_BYTES
    daemon = daemons(
        answer_with_tensor(b"\x02" * bound),
        answer_with_tensor(oversized),
        answer_with_tensor(b"\x03" * 16),
    )
    x = {"x": np.zeros(4, np.float32)}
    with InferenceClient(daemon.endpoint, timeout=HANG_S, max_reply_frame_bytes=bound) as client:
        assert client.infer("m", x)["y"].nbytes == bound  # a frame of the bound arrives
        assert client.send_buffer["sized"] == 1  # the monitor is shared
        message = ""

        def refused() -> None:
            nonlocal message
            message = _raises_connection_lost(lambda: client.infer("m", x))()

        growth = _peak_rss_growth(refused)
        assert growth < _RSS_GROWTH_BOUND, f"the peak RSS grew {growth / 2**20:.1f} MiB"
        assert f"over {bound} bytes" in message and "max_reply_frame_bytes" in message
        assert bytes(client.infer("m", x)["y"]) == b"\x03" * 16  # connected again
        assert client.connections_lost == 1
        assert client.send_buffer["sized"] == 2  # the new connection is sized too
    assert daemon.requests == 3


def test_one_byte_over_the_bound_is_over_it(daemons: Callable[..., Daemon]) -> None:
    daemon = daemons(answer_with_tensor(b"\x01" * 1025), answer_with_tensor(b"\x01" * 1024))
    x = {"x": np.zeros(4, np.float32)}
    with InferenceClient(daemon.endpoint, timeout=HANG_S, max_reply_frame_bytes=1024) as client:
        with pytest.raises(ConnectionLost):
            client.infer("m", x)
        assert client.infer("m", x)["y"].nbytes == 1024


def test_a_frame_of_the_bound_arrives_over_curve() -> None:
    """Over CURVE a frame travels in a MESSAGE command 33 bytes longer: the bound
    on the socket makes room for it."""
    bound = 1 << 20
    daemon, curve = Daemon.over_curve(
        [answer_with_tensor(b"\x02" * bound), answer_with_tensor(b"\x02" * (bound + 1))]
    )
    x = {"x": np.zeros(4, np.float32)}
    try:
        with InferenceClient(
            daemon.endpoint, timeout=HANG_S, curve=curve, max_reply_frame_bytes=bound
        ) as client:
            assert client.infer("m", x)["y"].nbytes == bound
            with pytest.raises(ConnectionLost):
                client.infer("m", x)
    finally:
        daemon.close()


def test_without_a_bound_a_large_reply_frame_is_taken(daemons: Callable[..., Daemon]) -> None:
    large = b"\x01" * (16 << 20)
    daemon = daemons(answer_with_tensor(large))
    with InferenceClient(daemon.endpoint, timeout=HANG_S, max_reply_frame_bytes=None) as client:
        assert client.infer("m", {"x": np.zeros(4, np.float32)})["y"].nbytes == len(large)
        assert client.connections_lost == 0


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "4096", 2**63])
def test_an_invalid_max_reply_frame_bytes_is_refused_before_any_socket(
    tmp_path: Path, value: Any
) -> None:
    context = mock.create_autospec(zmq.Context, instance=True)
    with pytest.raises(InvalidArgument, match="max_reply_frame_bytes") as caught:
        InferenceClient(
            f"ipc://{tmp_path}/infer.sock", context=context, max_reply_frame_bytes=value
        )
    assert isinstance(caught.value, ValueError)
    assert not context.socket.called


def test_a_daemon_that_goes_away_while_a_request_waits_fails_it_at_once(
    daemons: Callable[..., Daemon],
) -> None:
    daemon = daemons(go_away, answer_ok)
    with InferenceClient(daemon.endpoint, timeout=HANG_S) as client:
        with pytest.raises(ConnectionLost, match="the daemon closed it"):
            client.describe()
        assert client.describe() == {"done": True}  # libzmq connected again
        assert client.connections_lost == 1
    assert daemon.requests == 2


def test_with_retries_a_request_the_daemon_went_away_from_is_sent_again(
    daemons: Callable[..., Daemon],
) -> None:
    daemon = daemons(go_away, answer_with_tensor(b"\x04" * 8))
    with InferenceClient(daemon.endpoint, timeout=HANG_S, retries=1) as client:
        assert bytes(client.infer("m", {"x": np.zeros(4, np.float32)})["y"]) == b"\x04" * 8
        assert client.connections_lost == 1
    assert daemon.requests == 2


def test_a_daemon_that_restarted_while_the_client_was_idle_fails_no_call(
    daemons: Callable[..., Daemon],
) -> None:
    """The news of the old connection's end is read before the next request is
    sent, so it is not taken for the end of the connection that request went on."""
    daemon = daemons(answer_ok, answer_ok)
    with OperatorClient(daemon.endpoint, timeout=HANG_S) as client:
        assert client.call("status") == {"done": True}
        daemon.handshakes.get(timeout=HANG_S)
        daemon.restart_when_idle()
        daemon.handshakes.get(timeout=HANG_S)  # the client's new connection is up
        assert client.call("status") == {"done": True}
        assert client.connections_lost == 1


def test_a_request_frame_over_the_daemons_bound_fails_at_once(tmp_path: Path) -> None:
    """The daemon's ``ZMQ_MAXMSGSIZE`` (twice ``bus.max_message_bytes``) ends the
    connection of an oversized request frame: the call ends then, not at its timeout."""
    daemon = Daemon(f"ipc://{tmp_path}/infer.sock", [answer_ok], max_message_size=1024)
    try:
        with InferenceClient(daemon.endpoint, timeout=HANG_S) as client:
            with pytest.raises(ConnectionLost, match="request frame was over"):
                client.infer("m", {"x": np.zeros(1024, np.float32)})
            assert client.describe() == {"done": True}
            assert client.connections_lost == 1
    finally:
        daemon.close()


def test_a_request_no_daemon_answers_still_times_out(daemons: Callable[..., Daemon]) -> None:
    def silent(daemon: Daemon, routing: bytes, request: dict[str, Any]) -> None:
        pass

    daemon = daemons(silent)
    with (
        OperatorClient(daemon.endpoint, timeout=0.2) as client,
        pytest.raises(RequestTimeout),
    ):
        client.call("status")
