"""The bound on replies between the engine worker and the bus (``bus/reply_handoff.py``)."""

from __future__ import annotations

import threading

from inferd.bus.reply_handoff import ReplyHandoff
from tests.conftest import HANG_S, wait_until

MIB = 1024 * 1024


def test_replies_fit_up_to_the_limit_and_one_always_fits_alone() -> None:
    handoff = ReplyHandoff(limit_bytes=8 * MIB)
    assert handoff.reserve(4 * MIB, timeout=0) and handoff.reserve(4 * MIB, timeout=0)
    assert not handoff.reserve(1, timeout=0)  # full: the worker would wait
    assert handoff.held_bytes == 8 * MIB and handoff.waits == 1
    handoff.taken(4 * MIB)
    handoff.taken(4 * MIB)
    assert handoff.reserve(100 * MIB, timeout=0)  # larger than the limit, but alone
    assert not handoff.reserve(1, timeout=0)


def test_a_waiting_worker_goes_on_once_the_bus_takes_a_reply() -> None:
    handoff = ReplyHandoff(limit_bytes=4 * MIB)
    assert handoff.reserve(4 * MIB, timeout=0)
    reserved = threading.Event()
    waiter = threading.Thread(
        target=lambda: handoff.reserve(4 * MIB, timeout=HANG_S) and reserved.set()
    )
    waiter.start()
    wait_until(lambda: handoff.waits == 1, message="the worker waiting")
    assert not reserved.is_set()
    handoff.taken(4 * MIB)
    waiter.join(HANG_S)
    assert reserved.is_set() and handoff.held_bytes == 4 * MIB


def test_a_closed_handoff_never_holds_the_worker() -> None:
    handoff = ReplyHandoff(limit_bytes=MIB)
    assert handoff.reserve(MIB, timeout=0)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: handoff.reserve(MIB, timeout=HANG_S) and done.set())
    waiter.start()
    handoff.close()
    waiter.join(HANG_S)
    assert done.is_set()
    assert handoff.reserve(10 * MIB, timeout=0)
