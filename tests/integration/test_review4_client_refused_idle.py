"""A refusal met while no call waited fails no call (review R2 of DESIGN.md 322, F2).

The request channel connects as it is made.  When the daemon refused that
connection (this uid held ``bus.max_connections``), the first call, made once
the daemon had room, raised ``ConnectionRefused`` at once without trying (the
review's run: "call 0: ConnectionRefused in 0.000s", then "call 1: served").
Such a call now connects anew and is served; only a refusal of the connection a
call waits for fails it."""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from inferd_client import ConnectionRefused, InferenceClient
from tests.conftest import DaemonFactory, wait_until
from tests.integration.test_review3_client_refused import (
    TIMEOUT_S,
    X,
    bounded_daemon,
    holding_the_bound,
    let_one_go,
    socket_counts,
)

pytestmark = pytest.mark.integration


def refusal_read(client: InferenceClient) -> int | None:
    """The refusal the client's watch has read (as the next call would), if any."""
    watch = client._channel._watch
    watch.check()
    refused: int | None = watch.refused
    return refused


def test_a_refusal_met_while_idle_fails_no_call(
    daemon_factory: DaemonFactory, identity_model: Any, context: zmq.Context[Any]
) -> None:
    daemon = bounded_daemon(daemon_factory, identity_model)
    holders = holding_the_bound(context, daemon.infer)
    with InferenceClient(daemon.infer, timeout=TIMEOUT_S) as client:
        # Refused as it was made, no call waiting.
        assert wait_until(lambda: refusal_read(client), message="the refusal read") == 400
        let_one_go(daemon, holders)
        refused = socket_counts(daemon, "infer")["connections_refused"]
        started = time.monotonic()
        try:
            output = client.infer("identity", {"input": X})["output"]
        except ConnectionRefused as exc:
            waited = time.monotonic() - started
            pytest.fail(f"a call that never tried was refused after {waited:.3f} s: {exc}")
        assert (output == X).all()
        assert socket_counts(daemon, "infer")["connections_refused"] == refused
        assert (client.infer("identity", {"input": X})["output"] == X).all()
    for sock in holders:
        sock.close(linger=0)
