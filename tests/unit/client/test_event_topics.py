"""A subscription the daemon would refuse fails in the client, at once and saying
why: the daemon closes the connection of a subscriber to a topic that is not a
prefix of one of its topics (DESIGN.md 124), which the client would only see as
a join that times out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd_client import EventSubscriber
from inferd_client import events as events_module
from inferd_client.cli import EXIT_UNREACHABLE, EXIT_USAGE, main
from inferd_wire.topics import TOPICS, check_topic
from tests.conftest import HANG_S

REFUSED = ["bogus", "thermals", "healthy", "Health", " health", "health ", "h*"]
ACCEPTED = ["", "h", "he", "health", "therm", "build", "alert", "run", "runtime"]


def _every_topic_named(message: str) -> bool:
    return all(topic in message for topic in TOPICS)


@pytest.mark.parametrize("topic", REFUSED)
def test_a_topic_no_event_can_match_is_refused_naming_the_topics(topic: str) -> None:
    with pytest.raises(ValueError, match="unknown event topic") as raised:
        check_topic(topic)
    assert repr(topic) in str(raised.value)
    assert _every_topic_named(str(raised.value))


@pytest.mark.parametrize("topic", ACCEPTED)
def test_a_topic_its_prefixes_and_the_empty_one_are_accepted(topic: str) -> None:
    assert check_topic(topic) == topic


class _NoSockets:
    """A context that fails the test if the subscriber makes a socket."""

    def socket(self, *_args: Any) -> Any:
        raise AssertionError("a socket was made for a topic the daemon refuses")


def test_the_subscriber_refuses_an_unknown_topic_before_any_socket_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_endpoint_check(endpoint: str) -> str:
        raise AssertionError("the endpoint was checked for a topic the daemon refuses")

    monkeypatch.setattr(events_module, "trusted_endpoint", no_endpoint_check)
    with pytest.raises(ValueError, match=r"unknown event topic 'bogus'") as raised:
        EventSubscriber(
            "ipc:///nowhere/events.sock", topics=["health", "bogus"], context=_NoSockets()
        )
    assert _every_topic_named(str(raised.value))


@pytest.mark.parametrize("topics", [(), ("",), ("he",), ("build", "thermal")])
def test_the_subscriber_takes_topics_and_their_prefixes(topics: tuple[str, ...]) -> None:
    """And subscribes to exactly those (none: every topic), as the publisher sees it."""
    context: zmq.Context[Any] = zmq.Context()
    try:
        publisher = context.socket(zmq.XPUB)  # receives each (un)subscription
        publisher.bind("inproc://events")
        with EventSubscriber("inproc://events", topics=topics, context=context):
            pass
        # Its subscriptions, then, as it closed, their cancellations: these end the list.
        messages: list[bytes] = []
        open_: set[bytes] = set()
        while not messages or open_:
            assert publisher.poll(int(HANG_S * 1000)), f"no more subscriptions after {messages}"
            message = publisher.recv()
            messages.append(message)
            (open_.add if message[:1] == b"\x01" else open_.discard)(message[1:])
        taken = sorted(message[1:] for message in messages if message[:1] == b"\x01")
        assert taken == sorted({topic.encode() for topic in topics} or {b""})
    finally:
        context.destroy(linger=0)


def test_inferctl_events_with_an_unknown_topic_is_a_usage_error_listing_the_topics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No daemon there: without the topic check this would exit 3 (no socket).
    endpoint = f"ipc://{tmp_path}/events.sock"
    assert main(["--events-endpoint", endpoint, "events", "--topic", "bogus"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "USAGE" in err and "'bogus'" in err and _every_topic_named(err)


def test_inferctl_events_json_reports_the_usage_error_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"ipc://{tmp_path}/events.sock"
    argv = ["--json", "--events-endpoint", endpoint, "events", "--topic", "health", "--topic", "x"]
    assert main(argv) == EXIT_USAGE
    out = capsys.readouterr().out
    assert '"code": "USAGE"' in out and _every_topic_named(out)


def test_inferctl_events_with_a_topic_prefix_goes_on_to_the_socket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"ipc://{tmp_path}/events.sock"
    assert main(["--events-endpoint", endpoint, "events", "--topic", "he"]) == EXIT_UNREACHABLE
    assert "no daemon socket" in capsys.readouterr().err
