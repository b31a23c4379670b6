"""A client that claims the routing ids libzmq would generate next no longer aborts
the daemon (third review, A's finding 1).

libzmq's ROUTER gives a peer that sets no routing id ``0x00`` and a 32-bit counter,
started at libc ``rand()``, which nothing seeded: every fresh daemon generated
``00e43c9869``, ``00e43c986a``... on its infer socket and ``00f4b0dc51``... on its
control socket.  It does not check the id it generates against those peers
claimed with ``ZMQ_ROUTING_ID`` (``add_out_pipe`` asserts), so a local client
holding DEALERs with those ids made the next ordinary connection abort the daemon
(SIGABRT, exit -6), after every restart.  The daemon now seeds ``rand()`` from the
kernel before it makes its ROUTERs (``bus/binding.py``).

The ordinary client here is a raw DEALER that sets no routing id, as a third-party
client may: inferd's own clients set one of their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq

from inferd_wire import protocol
from tests.conftest import HANG_S, DaemonProcess, wait_until
from tests.integration.wire import IDENTITY_SHAPE, infer_header, pack

pytestmark = pytest.mark.integration

#: The first id an unseeded libzmq generated on each socket of a fresh daemon
#: (review A's probe for the infer socket; measured likewise for control), and how
#: many ids from there a client claims: those generated next, with a margin for
#: the peers that connected before (the readiness check, on control).
UNSEEDED_FIRST_IDS = {"infer": 0xE43C9869, "control": 0xF4B0DC51}
CLAIMED = 20


def dealer(
    context: zmq.Context[Any], endpoint: str, routing_id: bytes | None = None
) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    return sock


def reply(
    daemon: DaemonProcess, sock: zmq.Socket[Any], parts: list[Any]
) -> tuple[dict[str, Any], list[bytes]]:
    """Send ``parts``; the reply's header and frames.  Fails at once if the daemon exits."""
    sock.send_multipart(parts)

    def answered() -> bool:
        code = daemon.process.poll()
        assert code is None, f"the daemon exited with {code}:\n{daemon.log()[-2000:]}"
        return bool(sock.poll(50, zmq.POLLIN))

    wait_until(answered, HANG_S, interval=0, message="a reply")
    header, *frames = sock.recv_multipart()
    return protocol.unpack_header(header), frames


def request(socket_name: str, request_id: int) -> list[Any]:
    """A request each socket answers any admitted peer."""
    op = "describe" if socket_name == "infer" else "health"
    return [pack({"v": 1, "id": request_id, "op": op})]


@pytest.mark.parametrize("socket_name", ["infer", "control"])
def test_claiming_the_ids_libzmq_would_generate_next_does_not_abort_the_daemon(
    identity_daemon: DaemonProcess, context: zmq.Context[Any], socket_name: str
) -> None:
    daemon = identity_daemon
    endpoint = getattr(daemon, socket_name)
    first = UNSEEDED_FIRST_IDS[socket_name]
    claims = [
        dealer(context, endpoint, b"\x00" + (first + k).to_bytes(4, "big")) for k in range(CLAIMED)
    ]
    for k, claim in enumerate(claims):  # held open (a socket collected is closed)
        # Answered: the ROUTER holds the claimed id (not merely a connection).
        assert reply(daemon, claim, request(socket_name, k))[0]["ok"] is True
    for ordinary_id in range(2):  # the next two ids the ROUTER generates
        ordinary = dealer(context, endpoint)
        assert ordinary.getsockopt(zmq.ROUTING_ID) == b""  # libzmq generates its id
        if socket_name == "infer":
            tensor = np.random.default_rng(ordinary_id).random(IDENTITY_SHAPE, np.float32)
            header = infer_header(ordinary_id, "identity", {"input": tensor})
            answer, frames = reply(daemon, ordinary, [pack(header), tensor])
            assert frames == [tensor.tobytes()]  # the identity model's output
        else:
            answer, _ = reply(daemon, ordinary, request(socket_name, ordinary_id))
        assert answer["ok"] is True and answer["id"] == ordinary_id, answer
    assert daemon.process.poll() is None
