"""``EventRelay``: a producer that never blocks, a consumer thread that may."""

from __future__ import annotations

import threading

import pytest

from inferd.engine_build.relay import EventRelay
from tests.conftest import HANG_S


class SlowConsumer:
    """Blocks on its first item until ``release``; records what it got, in order."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.busy = threading.Event()
        self.release = threading.Event()

    def __call__(self, item: str) -> None:
        self.busy.set()
        assert self.release.wait(HANG_S)
        if item == "boom":
            raise RuntimeError("a broken sink")
        self.got.append(item)


def test_offers_beyond_capacity_are_dropped_puts_never_and_order_holds() -> None:
    consumer = SlowConsumer()
    relay: EventRelay[str] = EventRelay(consumer, capacity=2, name="test-relay")
    relay.put("first")
    assert consumer.busy.wait(HANG_S)  # the consumer holds "first"; the producer goes on
    assert relay.offer("step-1") and relay.offer("step-2")
    assert not relay.offer("step-3")  # two wait already: dropped, not waited for
    relay.put("phase_finish")  # must arrive, whatever the backlog
    relay.put("boom")
    relay.put("outcome")
    assert relay.dropped == 1
    consumer.release.set()
    assert relay.close(HANG_S)
    assert consumer.got == ["first", "step-1", "step-2", "phase_finish", "outcome"]
    assert relay.delivery_errors == 1


def test_a_closed_relay_refuses_what_must_arrive() -> None:
    relay: EventRelay[str] = EventRelay(lambda _item: None, capacity=1, name="test-relay")
    assert relay.close(HANG_S)
    assert not relay.offer("late step") and relay.dropped == 1
    with pytest.raises(RuntimeError, match="closed"):
        relay.put("late outcome")
