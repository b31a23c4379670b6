"""Per-model bounded request queues feeding one engine worker.

Thread-safe: the bus thread submits and expires, the engine worker takes.
Deadlines are swept by the bus thread as they fall due, so a request whose
deadline passes while it waits behind a long inference is answered
``DEADLINE_EXCEEDED`` at once rather than when it would finally be dequeued
(the failure mode of Triton's queue timeouts, server #7512).

Besides its condition variable the scheduler signals an ``eventfd``
(``wake_fd``) when the worker, waiting on it together with the request sources
(DESIGN.md 101), has something new to take.  Only a waiting worker is signalled
(``begin_wait``/``end_wait``): a job the worker admits itself, the common case,
costs no system call (DESIGN.md 106).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferd.bus.codec import Parsed
from inferd.config import QueuePolicy
from inferd.shm.leases import RequestRegions
from inferd.types import EngineHandle
from inferd_wire.protocol import RequestId


@dataclass
class Job:
    envelope: list[bytes]
    request_id: RequestId
    model: str
    #: Validated zero-copy inputs; None when the request arrived while its model
    #: was still loading (no IO spec yet): the worker validates it before running.
    inputs: dict[str, np.ndarray] | None
    received_ns: int
    deadline_ns: int | None
    #: The received tensor frames (``inputs`` views their memory).
    frames: Any = field(default=None, repr=False)
    #: Its inputs as the header described them, parsed (``bus.codec.check_descriptors``),
    #: kept for late validation: never the header, which unknown keys a client may
    #: fill (a 64 KiB header of empty maps decodes to 4.5 MiB) would make large.
    described: list[Parsed] = field(default_factory=list, repr=False)
    #: Bytes of the tensor frames: what the job holds while it is queued.
    nbytes: int = 0
    #: The shared-memory regions its tensors live in, leased until ``finish``.
    regions: RequestRegions | None = field(default=None, repr=False)
    #: Writable region views of the outputs it placed (validated like ``inputs``;
    #: None until then).
    outputs: dict[str, np.ndarray] | None = field(default=None, repr=False)
    #: The engine whose IO spec ``inputs`` and ``outputs`` were checked against: a
    #: job that another engine (a switch, a failover) is to run is checked anew.
    checked_against: EngineHandle | None = field(default=None, repr=False)
    #: The most bytes the client takes in one reply frame (None: no bound): a reply
    #: with a longer frame is answered RESOURCE_EXHAUSTED instead.
    max_reply_frame_bytes: int | None = None

    def finish(self) -> None:
        """The job is answered: drop its views of tensors and give its region leases
        back (views first: a region is unmapped only once no view of it is alive).
        The frames stay with the job object (freeing them is not worth doing on the
        way to the reply)."""
        self.inputs = None
        self.outputs = None
        if self.regions is not None:
            self.regions.release()

    @property
    def client(self) -> bytes:
        return self.envelope[0]


class InHand:
    """The job the engine worker runs, and who answers it: the worker once the run
    ends (``let_go``), or the stop when the run outlives its wait for the worker
    (``take_back``, ``serving.stop_worker``), whichever comes first, never both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._job: Job | None = None

    def hold(self, job: Job) -> None:
        self._job = job

    def let_go(self, job: Job) -> bool:
        """The worker answers ``job``: False when the stop took it back (answered)."""
        with self._lock:
            mine, self._job = self._job is job, None
            return mine

    def take_back(self) -> Job | None:
        with self._lock:
            job, self._job = self._job, None
            return job


class QueueFullError(Exception):
    pass


class QueueBytesFullError(Exception):
    """Queuing the job would take its model's queued bytes over ``queue_max_bytes``."""

    def __init__(self, queued_bytes: int, max_bytes: int) -> None:
        super().__init__(f"{queued_bytes} bytes queued; the limit is {max_bytes}")
        self.queued_bytes = queued_bytes
        self.max_bytes = max_bytes


class SchedulerClosedError(Exception):
    pass


@dataclass
class _ModelQueue:
    capacity: int
    policy: QueuePolicy
    max_bytes: int
    jobs: deque[Job] = field(default_factory=deque)
    #: Sum of the queued jobs' ``nbytes``.
    nbytes: int = 0


class Scheduler:
    def __init__(self) -> None:
        # Critical sections take the lock itself: entering the Condition is two
        # Python-level calls more, several times per request.
        self._lock = threading.RLock()
        self._condition = threading.Condition(self._lock)
        #: Threads waiting on the condition (``take`` with a timeout, ``wait_idle``):
        #: with none, the worker's own submits and replies skip notifying it.
        self._condition_waiters = 0
        self._queues: dict[str, _ModelQueue] = {}
        self._names: list[str] = []
        #: Models whose jobs are not taken (failing over); their queues still fill.
        self._paused: set[str] = set()
        self._next = 0
        self._closed = False
        self._calls: deque[Callable[[], None]] = deque()
        self._in_flight = 0
        #: Queued jobs that carry a deadline; lets ``next_deadline_ns`` skip the
        #: lock and the scan on the bus thread's every loop when there are none.
        self._with_deadline = 0
        #: Readable when the worker, between ``begin_wait`` and ``end_wait``, has
        #: something new to take.
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Closed with the scheduler object, not by close(): the worker may still
        # be polling it when the scheduler closes.
        weakref.finalize(self, os.close, self.wake_fd)
        #: Between ``begin_wait`` and ``end_wait``: new work writes ``wake_fd``.
        self._worker_waits = False
        #: ``wake_fd`` holds a count ``end_wait`` has not read yet.
        self._wake_written = False
        #: Counts what woke the worker (a job, a call, a resume, the close): it
        #: compares this across a step of its own to see whether the step gave
        #: it work, without a system call.
        self.wakes = 0

    def begin_wait(self) -> bool:
        """The worker is about to wait on ``wake_fd``: False when it should not,
        because there is something to take already (or the scheduler closed);
        else anything new until ``end_wait`` makes ``wake_fd`` readable."""
        with self._lock:
            if self._closed or self._calls or self._pop_round_robin(take=False) is not None:
                return False
            self._worker_waits = True
            return True

    def end_wait(self) -> None:
        """The worker has stopped waiting on ``wake_fd``: reset it."""
        with self._lock:
            self._worker_waits = False
            if self._wake_written:
                os.eventfd_read(self.wake_fd)
                self._wake_written = False

    def _wake(self) -> None:
        """Wake the worker (call with the condition held)."""
        if self._condition_waiters:
            self._condition.notify()
        self._signal_worker()

    def _signal_worker(self) -> None:
        self.wakes += 1
        if self._worker_waits and not self._wake_written:
            os.eventfd_write(self.wake_fd, 1)
            self._wake_written = True

    def add_model(
        self, name: str, capacity: int, policy: QueuePolicy, max_bytes: int = 2**63 - 1
    ) -> None:
        with self._lock:
            self._queues[name] = _ModelQueue(capacity, policy, max_bytes)
            self._names.append(name)

    def submit(self, job: Job) -> Job | None:
        """Queue ``job``; returns the job it superseded under the ``latest`` policy.

        Raises ``QueueFullError`` or ``QueueBytesFullError`` (nothing changes, the
        job a refused one would have superseded stays queued) or ``SchedulerClosedError``.
        """
        with self._lock:
            if self._closed:
                raise SchedulerClosedError
            model_queue = self._queues[job.model]
            superseded = None
            if model_queue.policy == "latest":
                superseded = next((j for j in model_queue.jobs if j.client == job.client), None)
            staying = len(model_queue.jobs) - (superseded is not None)
            if staying >= model_queue.capacity:
                raise QueueFullError
            staying_bytes = model_queue.nbytes - (superseded.nbytes if superseded else 0)
            if staying_bytes + job.nbytes > model_queue.max_bytes:
                raise QueueBytesFullError(staying_bytes, model_queue.max_bytes)
            if superseded is not None:
                model_queue.jobs.remove(superseded)
                self._forget(model_queue, superseded)
            model_queue.jobs.append(job)
            model_queue.nbytes += job.nbytes
            if job.deadline_ns is not None:
                self._with_deadline += 1
            self._wake()
            return superseded

    def pause(self, name: str) -> None:
        """Take no job of model ``name`` until ``resume`` (it fails over): its
        requests wait, as while it loads, and their deadlines are still swept."""
        with self._lock:
            self._paused.add(name)

    def resume(self, name: str) -> None:
        with self._lock:
            self._paused.discard(name)
            self._wake()

    def call_on_worker(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the engine worker before its next job (e.g. an engine
        swap between two requests).  Raises SchedulerClosedError once closed."""
        with self._lock:
            if self._closed:
                raise SchedulerClosedError
            self._calls.append(call)
            self._wake()

    def take(self, timeout: float | None = None) -> Job | Callable[[], None] | None:
        """The next call for the worker if any, else the next job (round-robin
        across models); None on timeout (at once with ``timeout=0``).  Raises
        ``SchedulerClosedError`` once closed.
        """
        with self._lock:
            while True:
                if self._closed:
                    raise SchedulerClosedError
                if self._calls:
                    return self._calls.popleft()
                job = self._pop_round_robin()
                if job is not None:
                    self._in_flight += 1
                    return job
                if timeout == 0 or not self._wait(timeout):
                    return None

    def _pop_round_robin(self, take: bool = True) -> Job | None:
        """The next job round-robin across models not paused (only looked at, not
        taken, with ``take=False``)."""
        count = len(self._names)
        for offset in range(count):
            index = (self._next + offset) % count
            model_queue = self._queues[self._names[index]]
            if model_queue.jobs and self._names[index] not in self._paused:
                if not take:
                    return model_queue.jobs[0]
                self._next = (index + 1) % count
                job = model_queue.jobs.popleft()
                self._forget(model_queue, job)
                return job
        return None

    def _forget(self, model_queue: _ModelQueue, job: Job) -> None:
        """Account for ``job`` leaving ``model_queue`` (call with the condition held)."""
        model_queue.nbytes -= job.nbytes
        if job.deadline_ns is not None:
            self._with_deadline -= 1

    def task_done(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._condition_waiters:
                self._condition.notify_all()

    def _wait(self, timeout: float | None, predicate: Callable[[], bool] | None = None) -> bool:
        """Wait on the condition (held), counted in ``_condition_waiters``."""
        self._condition_waiters += 1
        try:
            if predicate is None:
                return self._condition.wait(timeout)
            return self._condition.wait_for(predicate, timeout)
        finally:
            self._condition_waiters -= 1

    def expire(self, now_ns: int) -> list[Job]:
        """Remove and return every queued job whose deadline has passed."""
        expired: list[Job] = []
        with self._lock:
            for model_queue in self._queues.values():
                if any(_expired(job, now_ns) for job in model_queue.jobs):
                    gone = [job for job in model_queue.jobs if _expired(job, now_ns)]
                    model_queue.jobs = deque(j for j in model_queue.jobs if not _expired(j, now_ns))
                    for job in gone:
                        self._forget(model_queue, job)
                    expired += gone
            if expired and self._condition_waiters:
                self._condition.notify_all()  # wait_idle may be waiting on the last of them
        return expired

    def next_deadline_ns(self) -> int | None:
        # Without a lock: an int read is atomic, jobs with deadlines are only
        # added under the bus's handler lock, which every caller holds, and a
        # count that is stale because the worker just took one only sends us
        # down the exact path below.
        if not self._with_deadline:
            return None
        with self._lock:
            deadlines = [job.deadline_ns for job in self._all_jobs() if job.deadline_ns is not None]
        return min(deadlines) if deadlines else None

    def _all_jobs(self) -> Iterator[Job]:
        for model_queue in self._queues.values():
            yield from model_queue.jobs

    def depth(self, name: str) -> int:
        with self._lock:
            return len(self._queues[name].jobs)

    def queued_bytes(self, name: str) -> int:
        """Tensor bytes the queued requests of model ``name`` hold."""
        with self._lock:
            return self._queues[name].nbytes

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running; True if that happened in time."""
        with self._lock:
            return self._wait(
                timeout, lambda: self._in_flight == 0 and not any(True for _ in self._all_jobs())
            )

    def close(self) -> list[Job]:
        """Refuse further work, wake the worker and return what was still queued."""
        with self._lock:
            self._closed = True
            remaining = list(self._all_jobs())
            for model_queue in self._queues.values():
                model_queue.jobs.clear()
                model_queue.nbytes = 0
            self._with_deadline = 0
            self._condition.notify_all()
            self._signal_worker()
            return remaining


def _expired(job: Job, now_ns: int) -> bool:
    return job.deadline_ns is not None and job.deadline_ns <= now_ns
