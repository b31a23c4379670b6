"""A connection the daemon refuses at its handshake fails the call at once
(review J's note on a hostile local client).

The daemon's ZAP handler refuses a handshake over ``bus.max_connections`` for
its peer (a local user: every connection that uid holds to the socket counts),
or one its access policy does not admit.  libzmq tries such a connection once
more, then never again, and the client learnt nothing: its call waited out its
whole timeout and raised a bare ``RequestTimeout``, while the reason was only in
the daemon's log.  The client's monitor sees the refusal
(``ZMQ_EVENT_HANDSHAKE_FAILED_AUTH``): the call now raises ``ConnectionRefused``
at once, and the next call connects anew.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import zmq

from inferd_client import ConnectionRefused, InferenceClient, OperatorClient
from tests.conftest import HANG_S, DaemonFactory, DaemonProcess, wait_until
from tests.integration.wire import IDENTITY_SHAPE, pack

pytestmark = pytest.mark.integration

#: ``bus.max_connections``: connections one peer may hold to each socket.
BOUND = 2
#: The timeout of the refused clients: what a refused call waited before.
TIMEOUT_S = 10.0
#: The identity model's input, which it serves back.
X = np.ones(IDENTITY_SHAPE, np.float32)


def socket_counts(daemon: DaemonProcess, name: str) -> dict[str, Any]:
    """``status.security.sockets.<name>``: its connections now, and those refused."""
    with OperatorClient(daemon.control, timeout=HANG_S) as operator:
        return dict(operator.status()["security"]["sockets"][name])


def held(context: zmq.Context[Any], endpoint: str, op: str) -> zmq.Socket[Any]:
    """A raw DEALER of this uid, admitted (answered) and held open."""
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(pack({"v": 1, "id": 1, "op": op}))
    assert sock.poll(int(HANG_S * 1000)), "a held connection was not answered"
    sock.recv_multipart()
    return sock


def bounded_daemon(daemon_factory: DaemonFactory, identity_model: Any) -> DaemonProcess:
    """A daemon serving ``identity`` that admits ``BOUND`` connections of a peer to
    each of its sockets."""
    return daemon_factory(
        models=[{"name": "identity", "path": str(identity_model)}],
        bus={"max_connections": BOUND},
    )


def holding_the_bound(
    context: zmq.Context[Any], endpoint: str, op: str = "describe"
) -> list[zmq.Socket[Any]]:
    """``BOUND`` connections of this uid to ``endpoint``, held: a client of it is refused."""
    return [held(context, endpoint, op) for _ in range(BOUND)]


def let_one_go(daemon: DaemonProcess, holders: list[zmq.Socket[Any]]) -> None:
    """One held connection to the infer socket closes; returns once the daemon has
    let it go (this uid is under the bound again)."""
    holders.pop().close(linger=0)
    wait_until(
        lambda: socket_counts(daemon, "infer")["connections"] < BOUND,
        message="the closed connection let go",
    )


def test_a_refused_connection_fails_the_call_at_once_and_the_next_call_connects_anew(
    daemon_factory: DaemonFactory, identity_model: Any, context: zmq.Context[Any]
) -> None:
    daemon = bounded_daemon(daemon_factory, identity_model)
    holders = holding_the_bound(context, daemon.infer)
    refused_before = socket_counts(daemon, "infer")["connections_refused"]
    with InferenceClient(daemon.infer, timeout=TIMEOUT_S) as client:
        started = time.monotonic()
        with pytest.raises(ConnectionRefused) as refused:
            client.infer("identity", {"input": X})
        waited = time.monotonic() - started
        assert waited < TIMEOUT_S / 2, f"refused after {waited:.3f} s"
        message = str(refused.value)
        assert daemon.infer in message and "refused" in message, message
        assert "bus.max_connections" in message and "connections_refused" in message
        assert refused.value.status == 400
        counts = socket_counts(daemon, "infer")
        assert counts["connections_refused"] > refused_before
        # One held connection leaves: the same client's next call connects anew.
        let_one_go(daemon, holders)
        assert (client.infer("identity", {"input": X})["output"] == X).all()
    # The control socket likewise, for an operator's client (inferctl).
    controllers = holding_the_bound(context, daemon.control, "health")
    with OperatorClient(daemon.control, timeout=TIMEOUT_S) as operator:
        started = time.monotonic()
        with pytest.raises(ConnectionRefused, match="refused this client's connection"):
            operator.health()
        waited = time.monotonic() - started
        assert waited < TIMEOUT_S / 2, f"refused after {waited:.3f} s"
    for sock in holders + controllers:
        sock.close(linger=0)
    assert "over bus.max_connections (2)" in daemon.log()
