"""A ZeroMQ socket the client cannot make is ``Unreachable``, naming the endpoint
and the errno, never a bare ``zmq.ZMQError`` (review RD, finding 2).

Before: with one or two descriptors free, the directory check passed, and making
the DEALER (or SUB) or its monitor failed ``EMFILE``; ``zmq.error.ZMQError: Too
many open files`` escaped ``InferenceClient``, ``OperatorClient`` and
``EventSubscriber``, against "every error is a ``ClientError``".  A socket made
anew at run time (after a lost connection) said only "Too many open files".
Now each says ``cannot make a socket for <endpoint>: EMFILE: Too many open
files``, as ``RegionChannel`` does for its own socket (DESIGN.md 302), and a
channel whose socket could not be made anew makes it at its next call.

The failure is injected where ZeroMQ makes the socket, or its monitor's PAIR
(``Socket.get_monitor_socket``), alone: a real descriptor limit would hit the
shared context's I/O thread too."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd_client import EventSubscriber, InferenceClient, OperatorClient, Unreachable
from tests.unit.client.scripted import Script, answer_ok

Made = Callable[[str], Any]
MAKERS: dict[str, Made] = {
    "InferenceClient": lambda endpoint: InferenceClient(endpoint, timeout=1),
    "OperatorClient": lambda endpoint: OperatorClient(endpoint, timeout=1),
    "EventSubscriber": lambda endpoint: EventSubscriber(endpoint),
}


def _emfile(*args: Any, **kwargs: Any) -> Any:
    raise zmq.ZMQError(errno.EMFILE)


def _expected(endpoint: str) -> str:
    return f"cannot make a socket for {endpoint}: EMFILE: Too many open files"


@pytest.mark.parametrize("failing", ["socket", "monitor"])
@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_a_socket_or_monitor_that_cannot_be_made_is_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, maker: str, failing: str
) -> None:
    endpoint = f"ipc://{tmp_path}/daemon.sock"
    if failing == "socket":
        monkeypatch.setattr(zmq.Context, "socket", _emfile)
    else:
        monkeypatch.setattr(zmq.Socket, "get_monitor_socket", _emfile)
    with pytest.raises(Unreachable) as raised:  # before: zmq.error.ZMQError
        MAKERS[maker](endpoint)
    assert str(raised.value) == _expected(endpoint)


def test_a_socket_that_cannot_be_made_anew_is_unreachable_and_made_by_the_next_call(
    server: Callable[[Script], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = server(answer_ok)
    with OperatorClient(endpoint, timeout=5) as client:
        assert client.call("status") is not None
        real_socket = zmq.Context.socket
        monkeypatch.setattr(zmq.Context, "socket", _emfile)
        # What a lost connection does (``_lost``): the socket is made anew.
        with pytest.raises(Unreachable) as raised:
            client._channel._renew()
        assert str(raised.value) == _expected(endpoint)
        # Still owed: a call at the limit says so the same way (before: a
        # ClientError "Too many open files", naming neither socket nor errno) ...
        with pytest.raises(Unreachable, match=r"cannot make a socket for .*: EMFILE"):
            client.call("status")
        # ... and once descriptors are free, the next call makes it and is answered.
        monkeypatch.setattr(zmq.Context, "socket", real_socket)
        assert client.call("status") is not None
