from __future__ import annotations

import select
import threading
import time

import pytest

from inferd.serving.scheduler import (
    Job,
    QueueBytesFullError,
    QueueFullError,
    Scheduler,
    SchedulerClosedError,
)
from tests.conftest import HANG_S, wait_until


def job(
    model: str = "a", client: bytes = b"c1", request_id: int = 1, deadline_ns: int | None = None
) -> Job:
    return Job(
        envelope=[client],
        request_id=request_id,
        model=model,
        inputs={},
        received_ns=time.monotonic_ns(),
        deadline_ns=deadline_ns,
    )


def scheduler(policy: str = "fifo", capacity: int = 3) -> Scheduler:
    s = Scheduler()
    s.add_model("a", capacity, policy)  # type: ignore[arg-type]
    s.add_model("b", capacity, "fifo")
    return s


def test_fifo_order_and_capacity() -> None:
    s = scheduler(capacity=2)
    s.submit(job(request_id=1))
    s.submit(job(request_id=2))
    with pytest.raises(QueueFullError):
        s.submit(job(request_id=3))
    assert s.depth("a") == 2
    taken = [s.take(0), s.take(0)]
    assert [j.request_id for j in taken if j] == [1, 2]
    assert s.take(0) is None


def test_round_robin_across_models() -> None:
    s = scheduler()
    for i in range(3):
        s.submit(job("a", request_id=i))
    s.submit(job("b", request_id=100))
    order = [s.take(0).model for _ in range(4)]  # type: ignore[union-attr]
    assert order[:2] == ["a", "b"]


def test_latest_policy_supersedes_only_the_same_client() -> None:
    s = scheduler(policy="latest")
    assert s.submit(job(client=b"c1", request_id=1)) is None
    assert s.submit(job(client=b"c2", request_id=2)) is None
    superseded = s.submit(job(client=b"c1", request_id=3))
    assert superseded is not None and superseded.request_id == 1
    assert [s.take(0).request_id for _ in range(2)] == [2, 3]  # type: ignore[union-attr]


def test_latest_policy_frees_room_before_the_capacity_check() -> None:
    s = scheduler(policy="latest", capacity=1)
    s.submit(job(client=b"c1", request_id=1))
    assert s.submit(job(client=b"c1", request_id=2)) is not None
    with pytest.raises(QueueFullError):
        s.submit(job(client=b"c2", request_id=3))


def test_expire_removes_only_due_jobs_and_reports_next_deadline() -> None:
    s = scheduler()
    now = time.monotonic_ns()
    s.submit(job(request_id=1, deadline_ns=now - 1))
    s.submit(job(request_id=2, deadline_ns=now + 10**9))
    s.submit(job(request_id=3))
    assert s.next_deadline_ns() == now - 1
    assert [j.request_id for j in s.expire(now)] == [1]
    assert s.next_deadline_ns() == now + 10**9
    assert s.depth("a") == 2


def test_expiring_the_last_queued_job_ends_a_wait_for_idle() -> None:
    # Shutdown's drain waits for idle: a queue emptied by deadlines must end it,
    # not leave it to run out its whole shutdown_drain_ms.
    s = scheduler()
    now = time.monotonic_ns()
    s.submit(job(deadline_ns=now - 1))
    idle: list[bool] = []
    waiting = threading.Thread(target=lambda: idle.append(s.wait_idle(timeout=10 * HANG_S)))
    waiting.start()
    wait_until(lambda: s._condition_waiters == 1, HANG_S, message="the wait began")
    assert [j.request_id for j in s.expire(now)] == [1]
    waiting.join(HANG_S)
    assert not waiting.is_alive() and idle == [True]


def test_take_blocks_until_submit_and_close_wakes_the_worker() -> None:
    s = scheduler()
    got: list[object] = []

    def worker() -> None:
        try:
            while True:
                item = s.take(timeout=5)
                if item is not None:
                    got.append(item.request_id)
                    s.task_done()
        except SchedulerClosedError:
            got.append("closed")

    thread = threading.Thread(target=worker)
    thread.start()
    s.submit(job(request_id=42))
    assert s.wait_idle(5)
    s.submit(job(request_id=43))
    s.submit(job(request_id=44))
    leftovers = s.close()
    thread.join(5)
    assert not thread.is_alive()
    assert got[0] == 42 and got[-1] == "closed"
    assert sorted(
        [*[g for g in got if isinstance(g, int)], *[j.request_id for j in leftovers]]
    ) == [42, 43, 44]
    with pytest.raises(SchedulerClosedError):
        s.submit(job())


def sized(
    nbytes: int, client: bytes = b"c1", request_id: int = 1, deadline_ns: int | None = None
) -> Job:
    queued = job(client=client, request_id=request_id, deadline_ns=deadline_ns)
    queued.nbytes = nbytes
    return queued


def bytes_scheduler(policy: str = "fifo", max_bytes: int = 100) -> Scheduler:
    s = Scheduler()
    s.add_model("a", 10, policy, max_bytes)  # type: ignore[arg-type]
    return s


def test_queued_bytes_are_bounded_per_model_and_a_refusal_changes_nothing() -> None:
    s = bytes_scheduler(max_bytes=100)
    s.submit(sized(60, request_id=1))
    s.submit(sized(40, request_id=2))
    assert s.queued_bytes("a") == 100
    with pytest.raises(QueueBytesFullError) as refused:
        s.submit(sized(1, request_id=3))
    assert (refused.value.queued_bytes, refused.value.max_bytes) == (100, 100)
    assert s.depth("a") == 2 and s.queued_bytes("a") == 100
    taken = s.take(0)
    assert isinstance(taken, Job) and taken.request_id == 1
    assert s.queued_bytes("a") == 40
    s.submit(sized(60, request_id=4))  # room again
    assert s.queued_bytes("a") == 100


def test_latest_policy_keeps_the_queued_job_when_its_successor_is_refused_for_bytes() -> None:
    s = bytes_scheduler(policy="latest", max_bytes=100)
    s.submit(sized(30, client=b"c1", request_id=1))
    s.submit(sized(50, client=b"c2", request_id=2))
    with pytest.raises(QueueBytesFullError):
        s.submit(sized(60, client=b"c1", request_id=3))  # 50 + 60 > 100 even without job 1
    assert s.queued_bytes("a") == 80 and s.depth("a") == 2
    superseded = s.submit(sized(50, client=b"c1", request_id=4))  # 50 + 50 fits once 1 goes
    assert superseded is not None and superseded.request_id == 1
    assert s.queued_bytes("a") == 100


def test_expire_and_close_give_the_bytes_back() -> None:
    s = bytes_scheduler(max_bytes=100)
    now = time.monotonic_ns()
    s.submit(sized(70, request_id=1, deadline_ns=now - 1))
    s.submit(sized(20, request_id=2))
    assert [j.request_id for j in s.expire(now)] == [1]
    assert s.queued_bytes("a") == 20
    assert [j.request_id for j in s.close()] == [2]
    assert s.queued_bytes("a") == 0


def _signalled(s: Scheduler) -> bool:
    """Whether ``wake_fd`` is readable now (the worker's poll would return)."""
    poller = select.poll()
    poller.register(s.wake_fd, select.POLLIN)
    return bool(poller.poll(0))


def test_wake_fd_is_written_only_while_the_worker_waits() -> None:
    s = scheduler()
    wakes = s.wakes
    s.submit(job(request_id=1))  # the worker admitting a request itself: no system call
    assert not _signalled(s) and s.wakes == wakes + 1
    assert not s.begin_wait()  # there is work: do not wait
    assert s.take(0) is not None

    assert s.begin_wait()
    assert not _signalled(s)
    s.submit(job(request_id=2))
    s.submit(job(request_id=3))
    assert _signalled(s) and s.wakes == wakes + 3
    s.end_wait()
    assert not _signalled(s)  # reset for the next wait
    assert [j.request_id for j in (s.take(0), s.take(0)) if isinstance(j, Job)] == [2, 3]


@pytest.mark.parametrize("event", ["call", "resume", "close"])
def test_whatever_gives_the_worker_work_wakes_its_wait(event: str) -> None:
    s = scheduler()
    s.pause("a")
    s.submit(job(request_id=1))
    assert s.begin_wait()  # a paused model's job is nothing to take
    wakes = s.wakes
    if event == "call":
        s.call_on_worker(lambda: None)
    elif event == "resume":
        s.resume("a")
    else:
        s.close()
    assert _signalled(s) and s.wakes == wakes + 1
    s.end_wait()
    assert not s.begin_wait()  # the call, the resumed job or the close is there to take
