"""The engine worker's busy poll (DESIGN.md 110): after each reply it polls the
request sources without sleeping for ``busy_poll_ns`` before it sleeps on them;
and the run time it tells the port when it goes to run (DESIGN.md 111).

The port here is one eventfd standing for a request source, so each test decides
exactly when a request "arrives": while the worker sleeps, or while it busy
polls (after it has served one, and drained the sources, which the port sees as
``serve_one([])``)."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from inferd.config import ModelConfig
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot
from inferd.types import EngineHandle, TensorSpec
from tests.conftest import HANG_S, wait_until


class EventfdPort:
    """``serving.engine_worker.RequestPort`` whose one source is an eventfd: a
    request waits while it holds a count, and reading it serves that request."""

    def __init__(self) -> None:
        self.source = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.listen_fds = (self.source,)
        #: Each drain (``serve_one`` with nothing ready): the worker polls next.
        self.drains: queue.Queue[None] = queue.Queue()
        self.served = threading.Event()
        #: What ``serve_one`` does with a request it reads (a test may queue a job).
        self.on_request: Callable[[], None] = lambda: None
        #: The ``last_run_ns`` of each ``worker_listening(False, ...)``.
        self.run_hints: queue.Queue[int] = queue.Queue()
        self.replies: queue.Queue[list[Any]] = queue.Queue()
        self.listening = False

    def close(self) -> None:
        os.close(self.source)

    def arrive(self) -> None:
        os.eventfd_write(self.source, 1)

    def worker_listening(self, listening: bool, last_run_ns: int = 0) -> None:
        # The bus arms its cover timer at each False and disarms it at each True.
        assert listening != self.listening, f"told listening={listening} twice"
        self.listening = listening
        if not listening:
            self.run_hints.put(last_run_ns)

    def serve_one(self, ready: list[int]) -> bool:
        if not ready:
            self.drains.put(None)
            return False
        if self.source not in ready:
            return False
        try:
            os.eventfd_read(self.source)
        except BlockingIOError:
            return False
        self.on_request()
        self.served.set()
        return True

    def send_reply(self, parts: list[Any]) -> None:
        self.replies.put(parts)


class TimedRuntime:
    """A runtime (``inferd.types.InferenceRuntime``, as the worker calls it) whose
    every run takes ``run_s``."""

    def __init__(self, run_s: float) -> None:
        self.run_s = run_s

    def infer(
        self, handle: EngineHandle, inputs: Mapping[str, np.ndarray], **placed: Any
    ) -> dict[str, np.ndarray]:
        time.sleep(self.run_s)  # the run itself, not a synchronisation
        return {"y": np.zeros(1, np.float32)}

    def release_engine(self, handle: EngineHandle) -> None:
        pass


def serving_slot(run_s: float) -> ModelSlot:
    slot = ModelSlot(ModelConfig(name="m", path=Path("m.onnx")))
    spec = (TensorSpec("x", "float32", (1,)),)
    slot.runtime = TimedRuntime(run_s)  # type: ignore[assignment]
    slot.handle = EngineHandle(
        1, "onnx_trt_ep", "0" * 64, spec, (TensorSpec("y", "float32", (1,)),)
    )
    slot.state = "serving"
    return slot


@contextmanager
def running_worker(
    busy_poll_ns: int,
    thermal: Callable[[], str] = lambda: "nominal",
    slots: dict[str, ModelSlot] | None = None,
) -> Iterator[tuple[EngineWorker, EventfdPort, Scheduler]]:
    port, scheduler = EventfdPort(), Scheduler()
    for name in slots or {}:
        scheduler.add_model(name, 4, "fifo")
    worker = EngineWorker(
        port,
        scheduler,
        slots or {},
        activate=lambda slot: None,
        thermal_summary=thermal,
        busy_poll_ns=busy_poll_ns,
    )
    worker.start()
    try:
        yield worker, port, scheduler
    finally:
        scheduler.close()  # ends a busy poll too: the scheduler's wakes change
        worker.join(HANG_S)
        port.close()
    assert not worker.is_alive()


def serve_first_request(port: EventfdPort) -> None:
    """One request, read while the worker sleeps: its next wait begins with a poll."""
    port.drains.get(timeout=HANG_S)  # about to sleep: it has served nothing yet
    port.arrive()
    assert port.served.wait(HANG_S)
    port.served.clear()
    port.drains.get(timeout=HANG_S)  # about to poll


def test_a_request_that_arrives_while_the_worker_busy_polls_is_caught_by_the_poll() -> None:
    # A poll far longer than the test: only the request can end it.
    with running_worker(busy_poll_ns=10 * int(HANG_S * 1e9)) as (worker, port, _):
        serve_first_request(port)
        port.arrive()
        assert port.served.wait(HANG_S)
        wait_until(lambda: worker.busy_polls_caught == 1, HANG_S, message="the poll caught it")
        assert worker.busy_polls_missed == 0
        status = worker.busy_poll_status()
        assert status["us"] == 10 * int(HANG_S * 1e6) and status["caught"] == 1


def test_a_poll_that_finds_nothing_ends_in_a_sleep_and_an_idle_worker_does_not_poll() -> None:
    busy_poll_ns = 2_000_000
    with running_worker(busy_poll_ns=busy_poll_ns) as (worker, port, _):
        serve_first_request(port)
        wait_until(lambda: worker.busy_polls_missed == 1, HANG_S, message="the poll ran out")
        assert worker.busy_poll_spent_ns >= busy_poll_ns
        assert worker.busy_poll_status()["spent_us"] >= busy_poll_ns // 1000
        # It sleeps now; each beat wakes it, and an idle wake-up polls no more
        # (by the second, a poll after the first would have ended).
        port.drains.get(timeout=HANG_S)
        port.drains.get(timeout=HANG_S)
        assert (worker.busy_polls_caught, worker.busy_polls_missed) == (0, 1)
        # A request that comes later is read all the same.
        port.arrive()
        assert port.served.wait(HANG_S)


def test_work_for_the_worker_ends_its_busy_poll_at_once() -> None:
    with running_worker(busy_poll_ns=10 * int(HANG_S * 1e9)) as (worker, port, scheduler):
        serve_first_request(port)
        called = threading.Event()
        scheduler.call_on_worker(called.set)
        # Long before the poll would have run out.
        assert called.wait(HANG_S)
        assert (worker.busy_polls_caught, worker.busy_polls_missed) == (1, 0)


def test_no_busy_poll_while_the_board_throttles() -> None:
    with running_worker(busy_poll_ns=10 * int(HANG_S * 1e9), thermal=lambda: "throttling") as (
        worker,
        port,
        _,
    ):
        serve_first_request(port)
        port.arrive()  # read by the worker's sleeping poll
        assert port.served.wait(HANG_S)
        port.drains.get(timeout=HANG_S)  # and it went round to wait again
        assert (worker.busy_polls_caught, worker.busy_polls_missed) == (0, 0)
        assert worker.busy_poll_spent_ns == 0


def test_a_worker_without_a_busy_poll_never_polls_busily() -> None:
    with running_worker(busy_poll_ns=0) as (worker, port, _):
        serve_first_request(port)
        port.arrive()
        assert port.served.wait(HANG_S)
        port.drains.get(timeout=HANG_S)
        assert worker.busy_poll_status() == {"us": 0, "caught": 0, "missed": 0, "spent_us": 0}


def test_the_worker_tells_the_port_how_long_its_last_run_took() -> None:
    run_s = 0.02
    with running_worker(busy_poll_ns=0, slots={"m": serving_slot(run_s)}) as (_, port, scheduler):

        def queue_a_job() -> None:
            job = Job(
                [b"client"], 1, "m", {"x": np.zeros(1, np.float32)}, time.monotonic_ns(), None
            )
            scheduler.submit(job)

        port.on_request = queue_a_job
        for _ in range(2):
            port.drains.get(timeout=HANG_S)
            port.arrive()
            port.replies.get(timeout=HANG_S)
        # Each time it stopped listening, to run: 0 until a run had finished,
        # then that run's time.
        hints = [port.run_hints.get(timeout=HANG_S)]
        while not port.run_hints.empty():
            hints.append(port.run_hints.get())
        assert hints[0] == 0
        after_runs = [hint for hint in hints if hint]
        assert after_runs and all(run_s * 1e9 <= hint < HANG_S * 1e9 for hint in after_runs)


def test_a_wait_that_ends_with_no_work_leaves_the_worker_listening() -> None:
    """A refusal (a request that queues no job) and an idle beat end a wait without
    work: the worker listens on, so the bus thread arms no cover in between (a
    cover that fired while the worker was descheduled there read the next
    request on the bus thread).  It stops listening to run, and when it ends."""
    with running_worker(busy_poll_ns=0, slots={"m": serving_slot(0.0)}) as (_, port, scheduler):
        port.drains.get(timeout=HANG_S)
        port.arrive()  # refused: no job
        assert port.served.wait(HANG_S)
        port.served.clear()
        port.drains.get(timeout=HANG_S)  # it waits again
        port.drains.get(timeout=HANG_S)  # and again, after an idle beat
        assert port.listening and port.run_hints.empty()

        def queue_a_job() -> None:
            job = Job(
                [b"client"], 1, "m", {"x": np.zeros(1, np.float32)}, time.monotonic_ns(), None
            )
            scheduler.submit(job)

        port.on_request = queue_a_job
        port.arrive()
        port.replies.get(timeout=HANG_S)
        assert port.run_hints.get(timeout=HANG_S) == 0  # stopped listening to run
        port.drains.get(timeout=HANG_S)
        assert port.listening
    assert not port.listening  # the thread ended: the bus thread reads
