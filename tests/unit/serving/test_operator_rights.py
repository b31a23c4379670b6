"""Control ops by right (``serving/requests.py``): read-only ops for anyone admitted
to the control socket, operator ops only for a verified operator; the others get
``PERMISSION_DENIED`` and the op never runs."""

from __future__ import annotations

import errno
import json
from typing import Any

import pytest
import zmq

from inferd.bus.codec import Request
from inferd.serving.requests import RequestRouter, Respond
from inferd.serving.scheduler import Scheduler
from inferd.types import Peer
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError

VIEWER = Peer("ipc", uid=1001, gid=1001, pid=11, user="viewer", operator=False)
OPERATOR = Peer("ipc", uid=1002, gid=1002, pid=12, user="ops", operator=True)


class Frame:
    """What libzmq attaches to a message of a connection the ZAP handler admitted."""

    def __init__(self, peer: Peer | None) -> None:
        self._user_id = None if peer is None else json.dumps(peer.as_record())

    def get(self, name: str) -> str:
        if name != "User-Id" or self._user_id is None:
            raise zmq.ZMQError(errno.EINVAL)  # what pyzmq raises for a missing property
        return self._user_id


def request(op: str, peer: Peer | None, **header: Any) -> Request:
    frame: Any = Frame(peer)
    return Request([b"id"], {"v": 1, "id": 1, "op": op, **header}, 1, op, [], frame)


class Ops:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Peer | None]] = []

    def router(self) -> RequestRouter:
        def read(_header: dict[str, Any]) -> dict[str, Any]:
            self.calls.append(("status", None))
            return {"state": "serving"}

        def operate(_header: dict[str, Any], peer: Peer) -> dict[str, Any]:
            self.calls.append(("build.start", peer))
            return {"started": True}

        def deferred(_header: dict[str, Any], peer: Peer, respond: Respond) -> None:
            self.calls.append(("runtime.switch", peer))
            respond({"switched": True})

        return RequestRouter(
            {},
            Scheduler(),
            {"status": read},
            operator_ops={"build.start": operate},
            deferred_ops={"runtime.switch": deferred},
        )


def test_read_only_ops_run_for_any_admitted_peer() -> None:
    ops = Ops()
    reply = ops.router().handle_control(request("status", VIEWER))
    assert reply is not None and reply.header["ok"] is True and ops.calls == [("status", None)]


@pytest.mark.parametrize("peer", [VIEWER, None], ids=["no-rights", "unverified"])
@pytest.mark.parametrize("op", ["build.start", "runtime.switch"])
def test_operator_ops_are_refused_before_they_run(op: str, peer: Peer | None) -> None:
    ops = Ops()
    router = ops.router()
    with pytest.raises(ProtocolError) as refused:
        router.handle_control(request(op, peer, model="demo"))
    assert refused.value.code is Code.PERMISSION_DENIED
    assert refused.value.message.startswith(f"{op} changes the daemon's state")
    assert "nothing was changed" in refused.value.message
    if peer is not None:
        assert "uid 1001 (viewer) pid 11" in refused.value.message
    assert ops.calls == [] and router.permission_denied == 1


def test_operators_run_them_with_their_verified_identity() -> None:
    ops = Ops()
    router = ops.router()
    reply = router.handle_control(request("build.start", OPERATOR, requested_by="root"))
    assert reply is not None and reply.header["result"] == {"started": True}
    assert router.handle_control(request("runtime.switch", OPERATOR)) is None  # answered later
    (owed,) = router.due_replies(0)
    assert protocol.unpack_header(owed.parts()[-1])["result"] == {"switched": True}
    assert ops.calls == [("build.start", OPERATOR), ("runtime.switch", OPERATOR)]


def test_an_unknown_op_is_invalid_for_everyone() -> None:
    with pytest.raises(ProtocolError) as refused:
        Ops().router().handle_control(request("build.nuke", VIEWER))
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert "['build.start', 'runtime.switch', 'status']" in refused.value.message


@pytest.mark.parametrize("op", ["build.start", "runtime.switch"])
def test_once_the_daemon_stops_accepting_operator_ops_are_refused_and_reads_answered(
    op: str,
) -> None:
    """Between the stop's first step and the switcher's and builds' own stops, a
    switch would start preparing an engine only to be given up."""
    ops = Ops()
    router = ops.router()
    router.accepting = False
    with pytest.raises(ProtocolError) as refused:
        router.handle_control(request(op, OPERATOR, model="demo"))
    assert refused.value.code is Code.UNAVAILABLE
    assert refused.value.message == f"the daemon is shutting down; {op} was not run"
    reply = router.handle_control(request("status", VIEWER))
    assert reply is not None and reply.header["ok"] is True
    assert ops.calls == [("status", None)]
