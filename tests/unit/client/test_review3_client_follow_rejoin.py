"""``EventSubscriber.follow`` tells its caller when it is back after a lost
connection, and ``inferctl build follow`` then asks ``build.status`` again (third
review of the Python client, finding 1).

A daemon that restarts publishes health events again, which kept a follow alive
for good: a followed build whose end was published while the connection was down
(or that the new daemon no longer knows) was followed forever.  Here a PUB that is
closed and bound again on the same path stands for the restarted daemon, and a
scripted ROUTER answers ``build.status``: ``running`` at first, ended after."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from inferd_client import EventSubscriber, OperatorClient, cli_build
from tests.conftest import HANG_S
from tests.unit.client.scripted import Script


class Restartable:
    """A PUB publishing ``health`` events every 2 ms on its own thread; ``restart()``
    closes it (its subscribers' connections end) and binds a new one on the same path."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._restart = threading.Event()
        self._stop = threading.Event()
        self.restarted = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _bound(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUB)
        sock.bind(self.endpoint)
        return sock

    def _run(self) -> None:
        sock = self._bound()
        seq = 0
        while not self._stop.wait(0.002):  # the daemon's health interval, not a sync
            if self._restart.is_set():
                self._restart.clear()
                sock.close(linger=0)
                sock = self._bound()
                self.restarted.set()
            seq += 1
            sock.send_multipart([b"health", msgpack.packb({"state": "serving", "seq": seq})])
        sock.close(linger=0)

    def restart(self) -> None:
        self._restart.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def events(tmp_path: Path) -> Iterator[Restartable]:
    publisher = Restartable(f"ipc://{tmp_path}/events.sock")
    yield publisher
    publisher.close()


def test_follow_calls_on_rejoined_once_back_after_a_lost_connection(
    events: Restartable,
) -> None:
    calls: list[int] = []
    with EventSubscriber(events.endpoint, topics=["health"]) as subscriber:
        subscriber.wait_joined(HANG_S, keep_health=True)
        followed = subscriber.follow(HANG_S, on_rejoined=calls.append)
        next(followed)
        events.restart()
        assert events.restarted.wait(HANG_S)
        # Health events go on across the restart; the follow says it was away.
        give_up_at = time.monotonic() + HANG_S
        while not calls and time.monotonic() < give_up_at:
            next(followed)
        assert calls == [1]
        assert subscriber.connections_lost == 1
        next(followed)  # and goes on
        assert calls == [1]


def build_status(states: list[str]) -> Script:
    """A script answering ``build.status`` of ``b1`` with each of ``states`` in turn
    (the last one again once they are used up)."""
    answered = [0]

    def script(sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        request = msgpack.unpackb(frames[1])
        state = states[min(answered[0], len(states) - 1)]
        answered[0] += 1
        build = {"build_id": "b1", "state": state}
        reply = {"v": 1, "id": request["id"], "ok": True, "result": {"build": build}}
        sock.send_multipart([frames[0], msgpack.packb(reply)])

    return script


@pytest.mark.parametrize(("ended", "well"), [("failed", False), ("completed", True)])
def test_build_follow_asks_the_state_again_after_a_lost_connection_and_ends_with_it(
    server: Callable[[Script], str],
    events: Restartable,
    capsys: pytest.CaptureFixture[str],
    ended: str,
    well: bool,
) -> None:
    control = server(build_status(["running", ended]))
    args = argparse.Namespace(
        build_command="follow", build_id="b1", timeout=HANG_S, json=True, count=0
    )
    result: list[bool] = []

    def subscriber(topics: list[str]) -> EventSubscriber:
        made = EventSubscriber(events.endpoint, topics=topics)
        original = made.wait_joined

        def joined(timeout: float, *, keep_health: bool = False) -> None:
            original(timeout, keep_health=keep_health)
            events.restart()  # joined: the daemon "restarts" now, the build ends unseen

        made.wait_joined = joined  # type: ignore[method-assign]
        return made

    follower = threading.Thread(
        target=lambda: result.append(
            cli_build.follow(args, lambda: OperatorClient(control, timeout=5), subscriber)
        ),
        daemon=True,
    )
    follower.start()
    follower.join(HANG_S)
    # Before: the follow went on for good on the new publisher's health events.
    assert not follower.is_alive(), "build follow did not end after the lost connection"
    assert result == [well]
    out, err = capsys.readouterr()
    states = [json.loads(line)["build"]["state"] for line in out.splitlines()]
    assert states == ["running", ended]
    assert err.count("lost and made again") == 1
    assert "asking build.status of b1 again" in err
