"""``EventPublisher.dropped`` is counted under the publisher's lock by every
thread that counts it: producers (a full queue, a stopped publisher), the
publisher thread (a payload it cannot encode, what is left at its end) and
``stop()`` (what a thread that never ran left queued).  Before, only
``publish`` held the lock, so the publisher thread's and ``stop``'s counts were
read-modify-writes racing the producers'."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import zmq

from inferd.bus.publisher import EventPublisher
from tests.conftest import HANG_S


class OwnedLock:
    """``threading.Lock``'s API, knowing which thread holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        acquired = self._lock.acquire(blocking, timeout)
        if acquired:
            self.owner = threading.get_ident()
        return acquired

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _traceback: TracebackType | None,
    ) -> None:
        self.release()


class CheckedPublisher(EventPublisher):
    """Notes the thread of each write of ``dropped`` made without ``_lock`` held
    (once ``watch()`` swapped in a lock that knows its owner)."""

    def watch(self) -> list[str]:
        self._lock = OwnedLock()  # type: ignore[assignment]
        self.unlocked_writes: list[str] = []
        return self.unlocked_writes

    def __setattr__(self, name: str, value: Any) -> None:
        lock = self.__dict__.get("_lock")
        held = isinstance(lock, OwnedLock) and lock.owner == threading.get_ident()
        if name == "dropped" and isinstance(lock, OwnedLock) and not held:
            self.unlocked_writes.append(threading.current_thread().name)
        super().__setattr__(name, value)


def _publisher(context: zmq.Context[Any], endpoint: str, capacity: int) -> CheckedPublisher:
    return CheckedPublisher(
        context, endpoint, health=dict, health_interval_s=60.0, capacity=capacity
    )


def test_every_writer_of_dropped_holds_the_lock(short_tmp_path: Any) -> None:
    context: zmq.Context[Any] = zmq.Context()
    try:
        publisher = _publisher(context, f"ipc://{short_tmp_path}/events.sock", capacity=2)
        unlocked = publisher.watch()
        publisher.publish("alert", {"code": "queued"})
        publisher.publish("alert", {"code": object()})  # unpackable: the thread drops it
        publisher.publish("alert", {"code": "over"})  # the queue is full: dropped here
        publisher.start()
        publisher.wait_bound(HANG_S)
        publisher.stop()  # what was queued is sent (or dropped) first
        publisher.join(HANG_S)
        assert not publisher.is_alive()
        publisher.publish("alert", {"code": "late"})  # stopped: dropped here
        assert publisher.dropped == 3  # the unpackable one, "over" and "late"

        never_ran = _publisher(context, "inproc://never-bound", capacity=4)
        unlocked_at_stop = never_ran.watch()
        never_ran.publish("alert", {"code": "left"})
        never_ran.stop()  # no thread will send it: counted by stop()
        assert never_ran.dropped == 1
    finally:
        context.destroy(linger=0)
    assert unlocked == []  # before: ['inferd-publisher'] (its encode failure)
    assert unlocked_at_stop == []  # before: ['MainThread']
