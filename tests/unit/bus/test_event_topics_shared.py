"""The daemon publishes under the topics the clients check subscriptions against
(``inferd_wire.topics``, one list), and the clients accept exactly the
subscriptions the daemon applies (``publisher.SUBSCRIBABLE``, DESIGN.md 124)."""

from __future__ import annotations

import string

import pytest

from inferd.bus import publisher
from inferd_wire import topics


def test_the_daemon_publishes_under_the_wire_packages_topics() -> None:
    assert publisher.TOPICS is topics.TOPICS


def test_the_clients_accept_exactly_what_the_daemon_applies() -> None:
    applied = {prefix.decode() for prefix in publisher.SUBSCRIBABLE}
    for prefix in applied:
        assert topics.check_topic(prefix) == prefix
    # One character more than anything applied: accepted only where the daemon applies it.
    for candidate in {p + c for p in applied for c in string.ascii_letters + " *."}:
        if candidate in applied:
            assert topics.check_topic(candidate) == candidate
        else:
            with pytest.raises(ValueError, match="unknown event topic"):
                topics.check_topic(candidate)
