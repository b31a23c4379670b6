"""The Python client's DEALERs set a routing id of their own (DESIGN.md 312, "Left").

A ROUTER gives a peer that sets no routing id one it generates, ``0x00`` and a
32-bit counter, and never checks it against the ids other peers claimed with
``ZMQ_ROUTING_ID``: when it generates a claimed one, ``add_out_pipe`` asserts and
the daemon aborts.  The daemon now seeds that counter, so a claim must find it
first; a client that sets its own id never takes that path at all.  Each socket
the request channel makes (a new one after a lost connection or a refusal) sets
16 bytes from the OS whose first is never 0 (the shape libzmq reserves for its
own ids), a new one each time: a socket made anew with the same id while the
ROUTER still held the old connection would be ignored as a duplicate.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd_client import ConnectionLost, InferenceClient, OperatorClient, RequestTimeout
from tests.conftest import (
    HANG_S,
    REPO,
    DaemonProcess,
    render_config,
    start_daemon,
    wait_until,
)
from tests.integration.test_review3_routing_ids import CLAIMED, UNSEEDED_FIRST_IDS
from tests.integration.wire import IDENTITY_SHAPE, pack
from tests.unit.client.scripted import Script, answer_ok


def routing_id_shaped_by_the_client(routing_id: bytes) -> bool:
    """16 bytes, the first not 0: never the 5-byte ``0x00`` + counter libzmq generates."""
    return len(routing_id) == 16 and routing_id[0] != 0


def test_every_client_socket_sets_its_own_random_routing_id(
    server: Callable[[Script], str],
) -> None:
    seen: list[bytes] = []

    def recording(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        seen.append(frames[0])
        answer_ok(sock, frames)

    endpoint = server(recording)
    x = {"x": np.zeros(2, np.float32)}
    with (
        InferenceClient(endpoint, timeout=HANG_S) as first,
        InferenceClient(endpoint, timeout=HANG_S) as second,
        OperatorClient(endpoint, timeout=HANG_S) as operator,
    ):
        first.infer("m", x)
        second.infer("m", x)
        operator.call("status")
        first.infer("m", x)
    assert len(seen) == 4
    assert all(routing_id_shaped_by_the_client(routing_id) for routing_id in seen), seen
    assert seen[3] == seen[0]  # one socket, one id
    assert len({seen[0], seen[1], seen[2]}) == 3, seen


def test_a_socket_made_anew_after_a_lost_connection_sets_a_new_routing_id(
    tmp_path: Path,
) -> None:
    endpoint = f"ipc://{tmp_path}/daemon.sock"
    context: zmq.Context[Any] = zmq.Context.instance()

    def answered_by(router: zmq.Socket[Any], call: Callable[[], object]) -> bytes:
        """``call()``, answered by ``router``: the routing id its request came with."""
        seen: list[bytes] = []

        def answer() -> None:
            if router.poll(int(HANG_S * 1000)):
                frames = router.recv_multipart()
                seen.append(frames[0])
                answer_ok(router, frames)

        thread = threading.Thread(target=answer)
        thread.start()
        call()
        thread.join(HANG_S)
        assert len(seen) == 1
        return seen[0]

    def bound_router() -> zmq.Socket[Any]:
        router: zmq.Socket[Any] = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        return router

    with OperatorClient(endpoint, timeout=HANG_S) as operator:
        before = bound_router()
        first = answered_by(before, lambda: operator.call("status"))
        before.close(linger=0)  # a daemon that stopped

        def lost() -> bool:
            # A call while no daemon is there reads the news: the connection ended,
            # and the socket is made anew (sent before the news came, the request
            # waited on the ended connection: ConnectionLost).
            with pytest.raises((RequestTimeout, ConnectionLost)):
                operator.call("status", timeout=0.05)
            return operator.connections_lost == 1

        wait_until(lost, message="the lost connection seen")
        after = bound_router()  # a daemon that started again
        try:
            second = answered_by(after, lambda: operator.call("status"))
        finally:
            after.close(linger=0)
    assert routing_id_shaped_by_the_client(first) and routing_id_shaped_by_the_client(second)
    assert first != second


#: Run in a fresh process (its libc ``rand()`` as no ``srand`` left it): a ROUTER
#: whose generated ids 20 DEALERs claimed from the first on, then the Python
#: clients, then (the control) a DEALER that sets no routing id.
_UNSEEDED = r"""
import ctypes, sys, threading
import msgpack, zmq
from inferd_client import InferenceClient, OperatorClient
from tests.unit.client.scripted import answer_ok

endpoint = sys.argv[1]
context = zmq.Context()
context.socket(zmq.PAIR).close()  # the context started before rand() is looked at
srand = ctypes.CDLL(None).srand

def health(request_id):
    return msgpack.packb({"v": 1, "id": request_id, "op": "health"})

# Where a ROUTER made now would start its generated ids: glibc's rand() without
# srand is rand() after srand(1), and a ROUTER draws its counter as it is made.
srand(1)
probe = context.socket(zmq.ROUTER)
probe.bind("inproc://probe")
srand(1)
router = context.socket(zmq.ROUTER)
router.bind(endpoint)
asker = context.socket(zmq.DEALER)
asker.connect("inproc://probe")
asker.send(b"?")
first = int.from_bytes(probe.recv_multipart()[0], "big")
assert first < 2**32, first  # 0x00 and the counter: 5 bytes

def serve():
    while True:
        answer_ok(router, router.recv_multipart())

threading.Thread(target=serve, daemon=True).start()
claims = []
for k in range(20):
    claim = context.socket(zmq.DEALER)
    claim.setsockopt(zmq.ROUTING_ID, (first + k).to_bytes(5, "big"))
    claim.connect(endpoint)
    claim.send(health(k))
    assert claim.poll(15000), "a claim unanswered"  # the ROUTER holds its id
    claim.recv_multipart()
    claims.append(claim)
with InferenceClient(endpoint, timeout=15) as client, OperatorClient(endpoint, timeout=15) as op:
    client.describe()
    op.health()
print("served", flush=True)
# The control: the next generated id is still the first claimed, and a DEALER that
# sets none is handed it: libzmq aborts.
ordinary = context.socket(zmq.DEALER)
ordinary.connect(endpoint)
ordinary.send(health(99))
ordinary.poll(15000)
print("the control was answered", flush=True)
"""


def test_the_clients_never_take_an_unseeded_routers_generated_ids(
    short_tmp_path: Path,
) -> None:
    """DESIGN.md 312's crash with no seed at all: peers that claimed the ids a ROUTER
    generates next do not make the Python clients abort it; a DEALER that sets no
    id still does (so the claims were live)."""
    endpoint = f"ipc://{short_tmp_path}/router.sock"
    ran = subprocess.run(
        [sys.executable, "-c", _UNSEEDED, endpoint],
        capture_output=True,
        text=True,
        timeout=2 * HANG_S,
        cwd=REPO,
    )
    assert "served" in ran.stdout, (ran.returncode, ran.stdout, ran.stderr[-2000:])
    assert ran.returncode == -signal.SIGABRT, (ran.returncode, ran.stdout, ran.stderr[-2000:])


#: ``inferd run`` with the seed of DESIGN.md 312 left out: the ids its ROUTERs
#: generate start where every unseeded daemon's did.
_UNSEEDED_DAEMON = (
    "import runpy, sys\n"
    "import inferd.bus.binding as binding\n"
    "binding.seed_generated_routing_ids = lambda: None\n"
    "sys.argv = ['inferd', *sys.argv[4:]]\n"  # after: -c, python, -m, inferd.cli
    "runpy.run_module('inferd.cli', run_name='__main__', alter_sys=True)\n"
)


@pytest.fixture
def unseeded_daemon(identity_model: Path, short_tmp_path: Path) -> Iterator[DaemonProcess]:
    text = render_config(short_tmp_path, [{"name": "identity", "path": str(identity_model)}])
    daemon = start_daemon(text, short_tmp_path, launcher=[sys.executable, "-c", _UNSEEDED_DAEMON])
    try:
        yield daemon
    finally:
        if daemon.process.poll() is None:
            daemon.stop()


@pytest.mark.integration
@pytest.mark.parametrize("socket_name", ["infer", "control"])
def test_a_real_unseeded_daemon_is_not_aborted_by_the_python_clients(
    unseeded_daemon: DaemonProcess, socket_name: str
) -> None:
    """The integration scenario of DESIGN.md 312 on a daemon that does not seed its
    generator: claims of the ids it generates next, then the ordinary Python client
    (before: the daemon aborted, -6); a raw DEALER that sets no id then still aborts
    it, so the client never took the generated path."""
    daemon = unseeded_daemon
    endpoint = getattr(daemon, socket_name)
    first = UNSEEDED_FIRST_IDS[socket_name]
    context: zmq.Context[Any] = zmq.Context()
    try:
        claims = []
        for k in range(CLAIMED):
            claim: zmq.Socket[Any] = context.socket(zmq.DEALER)
            claim.setsockopt(zmq.LINGER, 0)
            claim.setsockopt(zmq.ROUTING_ID, b"\x00" + (first + k).to_bytes(4, "big"))
            claim.connect(endpoint)
            op = "describe" if socket_name == "infer" else "health"
            claim.send(pack({"v": 1, "id": k, "op": op}))
            assert claim.poll(int(HANG_S * 1000)), "a claim unanswered"
            claim.recv_multipart()  # answered: the ROUTER holds the claimed id
            claims.append(claim)
        if socket_name == "infer":
            tensor = np.random.default_rng(0).random(IDENTITY_SHAPE, np.float32)
            with InferenceClient(endpoint, timeout=HANG_S) as client:
                assert (client.infer("identity", {"input": tensor})["output"] == tensor).all()
        else:
            with OperatorClient(endpoint, timeout=HANG_S) as operator:
                assert operator.health()["state"] == "serving"
        assert daemon.process.poll() is None
        # The control: the claims are live, and a DEALER that sets no id takes one.
        ordinary: zmq.Socket[Any] = context.socket(zmq.DEALER)
        ordinary.setsockopt(zmq.LINGER, 0)
        ordinary.connect(endpoint)
        ordinary.send(pack({"v": 1, "id": 99, "op": "health"}))
        code = wait_until(daemon.process.poll, HANG_S, message="the control's abort")
        assert code == -signal.SIGABRT
    finally:
        context.destroy(linger=0)
