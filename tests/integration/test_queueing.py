"""Queueing through a real daemon: back-pressure, deadlines swept while queued,
the ``latest`` policy and shutdown with requests in flight.

A CPU-slow chained-MatMul model makes the engine worker busy for a known
time, so queues build deterministically."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from inferd_client import OperatorClient
from tests.conftest import DaemonFactory, DaemonProcess, wait_until, write_slow_model
from tests.integration.wire import RawDealer, assert_error, model_status

pytestmark = pytest.mark.integration

SIZE = 512
#: Target time of one inference of the slow model on the daemon's single thread.
TARGET_CALL_S = 0.15


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, float]]:
    """The slow model sized to ~TARGET_CALL_S per call here, and its measured call time."""
    directory = tmp_path_factory.mktemp("slow")
    probe = write_slow_model(directory / "probe.onnx", matmuls=4, size=SIZE)
    per_matmul = _call_time(probe) / 4
    matmuls = max(2, min(200, round(TARGET_CALL_S / per_matmul)))
    path = write_slow_model(directory / "slow.onnx", matmuls=matmuls, size=SIZE)
    yield path, _call_time(path)


def _call_time(path: Path) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = np.ones((SIZE, SIZE), np.float32)
    session.run(None, {"x": x})
    started = time.perf_counter()
    for _ in range(3):
        session.run(None, {"x": x})
    return (time.perf_counter() - started) / 3


def _x(value: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": np.full((SIZE, SIZE), value, np.float32)}


def _slow_daemon(factory: DaemonFactory, path: Path, **model: Any) -> DaemonProcess:
    return factory(models=[{"name": "slow", "path": str(path), **model}])


def _collect(dealer: RawDealer, count: int, timeout: float) -> list[tuple[float, dict[str, Any]]]:
    """``count`` replies as (arrival monotonic time, header); fails on timeout."""
    replies = []
    give_up_at = time.monotonic() + timeout
    while len(replies) < count:
        remaining = give_up_at - time.monotonic()
        assert remaining > 0, f"only {len(replies)} of {count} replies within {timeout} s"
        header, _ = dealer.recv(timeout=remaining)
        replies.append((time.monotonic(), header))
    return replies


def _assert_silent(dealer: RawDealer, seconds: float = 0.3) -> None:
    extra = dealer.recv_raw(timeout=seconds)
    assert extra is None, f"unexpected extra reply {extra[:1]!r}"


def _wait_queued(daemon: DaemonProcess, depth: int, timeout: float = 5) -> None:
    with OperatorClient(daemon.control, timeout=5) as operator:
        wait_until(
            lambda: operator.health()["models"]["slow"]["queue_depth"] >= depth,
            timeout,
            message=f"queue depth {depth}",
        )


def test_slow_model_is_slow_enough(slow_model: tuple[Path, float]) -> None:
    _, call_s = slow_model
    assert 0.05 < call_s < 0.6, call_s


def test_queue_full_answers_resource_exhausted_once_per_request(
    daemon_factory: DaemonFactory, slow_model: tuple[Path, float]
) -> None:
    path, call_s = slow_model
    daemon = _slow_daemon(daemon_factory, path, queue_capacity=2)
    total = 20
    with RawDealer(daemon.infer) as dealer:
        for request_id in range(1, total + 1):
            dealer.send_infer(request_id, "slow", _x(request_id))
        replies = _collect(dealer, total, timeout=10 + 5 * call_s)
        _assert_silent(dealer)
    ids = [header["id"] for _, header in replies]
    assert sorted(ids) == list(range(1, total + 1)), "every request answered exactly once"
    codes = Counter("OK" if header["ok"] else header["error"]["code"] for _, header in replies)
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    # One runs, two wait; everything else is refused at once.
    assert 2 <= codes["OK"] <= 4, codes
    assert codes["RESOURCE_EXHAUSTED"] == total - codes["OK"]
    for _, header in replies:
        if not header["ok"]:
            assert_error(
                header,
                "RESOURCE_EXHAUSTED",
                "queue of model 'slow' is full (2 requests)",
                header["id"],
            )
    # Refusals are immediate: they all arrive before the first result.
    first_ok = min(at for at, header in replies if header["ok"])
    last_refusal = max(at for at, header in replies if not header["ok"])
    assert last_refusal < first_ok
    status = model_status(daemon.control, "slow")
    assert status["requests"] == total
    assert status["responses"] == dict(codes)
    assert status["queue_depth"] == 0


def test_deadline_is_answered_promptly_while_work_is_queued(
    daemon_factory: DaemonFactory, slow_model: tuple[Path, float]
) -> None:
    path, call_s = slow_model
    daemon = _slow_daemon(daemon_factory, path)
    backlog = max(4, round(1.0 / call_s))  # about one second of work
    with RawDealer(daemon.infer) as busy, RawDealer(daemon.infer) as hurried:
        sent_at = time.monotonic()
        for request_id in range(backlog):
            busy.send_infer(request_id, "slow", _x())
        _wait_queued(daemon, backlog - 2)
        hurried_at = time.monotonic()
        hurried.send_infer("hurry", "slow", _x(), deadline_ms=50)
        header, frames = hurried.recv(timeout=5)
        answered_s = time.monotonic() - hurried_at
        assert_error(header, "DEADLINE_EXCEEDED", "deadline passed", "hurry")
        assert frames == []
        work = _collect(busy, backlog, timeout=10 + backlog * call_s * 3)
        work_s = max(at for at, _ in work) - sent_at
    assert all(h["ok"] for _, h in work), [h for _, h in work if not h["ok"]]
    assert 0.045 <= answered_s < 0.3, f"DEADLINE_EXCEEDED after {answered_s:.3f} s"
    assert work_s > 3 * answered_s, (work_s, answered_s)
    status = model_status(daemon.control, "slow")
    assert status["responses"] == {"OK": backlog, "DEADLINE_EXCEEDED": 1}


def test_default_deadline_from_model_config_applies(
    daemon_factory: DaemonFactory, slow_model: tuple[Path, float]
) -> None:
    path, call_s = slow_model
    default_ms = max(100, int(call_s * 1000 * 2))
    daemon = _slow_daemon(daemon_factory, path, default_deadline_ms=default_ms)
    backlog = 8  # far more work than the default deadline allows
    with (
        RawDealer(daemon.infer) as busy,
        RawDealer(daemon.infer) as other,
        RawDealer(daemon.infer) as explicit,
    ):
        for request_id in range(backlog):
            busy.send_infer(request_id, "slow", _x(), deadline_ms=60_000)
        _wait_queued(daemon, backlog - 2)
        # No deadline in the header: the model's default applies.
        sent_at = time.monotonic()
        other.send_infer("defaulted", "slow", _x())
        # An explicit header deadline overrides the default.
        explicit.send_infer("explicit", "slow", _x(), deadline_ms=60_000)
        header, _ = other.recv(timeout=default_ms / 1000 + 5)
        answered_s = time.monotonic() - sent_at
        assert_error(header, "DEADLINE_EXCEEDED", "deadline passed", "defaulted")
        work = _collect(busy, backlog, timeout=backlog * call_s * 3 + 10)
        explicit_header, frames = explicit.recv(timeout=10)
    assert default_ms / 1000 - 0.005 <= answered_s < default_ms / 1000 + 0.3, answered_s
    assert all(h["ok"] for _, h in work)
    assert explicit_header["ok"] is True and explicit_header["id"] == "explicit"
    assert len(frames) == 1


def test_a_result_finished_after_its_deadline_is_served_and_flagged_late(
    daemon_factory: DaemonFactory, slow_model: tuple[Path, float]
) -> None:
    path, call_s = slow_model
    daemon = _slow_daemon(daemon_factory, path)
    # A request on the idle worker starts at once and finishes about call_s later:
    # past a deadline of a fraction of that. Shorter fractions follow in case this
    # machine runs the model faster than it did when measured, or starts it late.
    late: tuple[dict[str, Any], list[bytes]] | None = None
    ok = expired = 0
    with RawDealer(daemon.infer) as dealer:
        for attempt, fraction in enumerate((0.6, 0.4, 0.25, 0.15, 0.08)):
            deadline_us = max(1, int(call_s * 1000 * fraction)) * 1000
            dealer.send_infer(attempt, "slow", _x(), deadline_ms=deadline_us // 1000)
            header, frames = dealer.recv(timeout=10)
            if not header["ok"]:  # it could not start in time: answered, never run
                assert_error(header, "DEADLINE_EXCEEDED", "deadline passed", attempt)
                expired += 1
                continue
            ok += 1
            took_us = header["queue_us"] + header["latency_us"]
            if abs(took_us - deadline_us) > 1000:  # clear of the rounding of the timings
                assert header["late"] is (took_us > deadline_us), header
            if header["late"]:
                late = header, frames
                break
        assert late is not None, "no result finished after its deadline"
        dealer.send_infer("in-time", "slow", _x(), deadline_ms=int(call_s * 1000 * 10) + 1000)
        in_time, _ = dealer.recv(timeout=10)
        dealer.send_infer("no-deadline", "slow", _x())
        undated, _ = dealer.recv(timeout=10)
    header, frames = late
    assert len(frames) == 1  # the outputs come anyway
    assert (in_time["ok"], in_time["late"]) == (True, False)
    assert (undated["ok"], undated["late"]) == (True, False)
    status = model_status(daemon.control, "slow")
    assert status["late_results"] == 1
    assert status["responses"] == {
        "OK": ok + 2,
        **({"DEADLINE_EXCEEDED": expired} if expired else {}),
    }


def test_latest_policy_supersedes_only_the_same_clients_queued_request(
    daemon_factory: DaemonFactory, slow_model: tuple[Path, float]
) -> None:
    path, call_s = slow_model
    daemon = _slow_daemon(daemon_factory, path, queue_policy="latest")
    with (
        RawDealer(daemon.infer) as a,
        RawDealer(daemon.infer) as b,
        OperatorClient(daemon.control) as operator,
    ):
        a.send_infer("a0", "slow", _x(0))

        def a0_running() -> bool:
            (model,) = operator.status()["models"]
            return bool(model["requests"] == 1 and model["queue_depth"] == 0)

        wait_until(a0_running, 5, interval=0.005, message="a0 on the engine worker")
        b.send_infer("b1", "slow", _x(1))
        a.send_infer("a1", "slow", _x(2))
        a.send_infer("a2", "slow", _x(3))
        b_replies = _collect(b, 1, timeout=10 + 5 * call_s)
        a_replies = _collect(a, 3, timeout=10 + 5 * call_s)
        _assert_silent(a)
        _assert_silent(b, 0.05)
    a_by_id = {header["id"]: header for _, header in a_replies}
    assert set(a_by_id) == {"a0", "a1", "a2"}
    assert a_by_id["a0"]["ok"] is True
    assert_error(a_by_id["a1"], "CANCELLED", "superseded", "a1")
    assert a_by_id["a2"]["ok"] is True
    ((_, b1),) = b_replies
    assert b1["ok"] is True and b1["id"] == "b1"
    status = model_status(daemon.control, "slow")
    assert status["responses"] == {"OK": 3, "CANCELLED": 1}
    assert status["queue_policy"] == "latest"


def test_sigterm_answers_every_request_in_flight_and_exits_zero(
    daemon_factory: DaemonFactory, slow_model: tuple[Path, float]
) -> None:
    path, call_s = slow_model
    daemon = _slow_daemon(daemon_factory, path)
    count = 6
    with RawDealer(daemon.infer) as dealer, OperatorClient(daemon.control) as operator:
        for request_id in range(count):
            dealer.send_infer(request_id, "slow", _x())
        _wait_queued(daemon, count - 2)
        daemon.process.send_signal(signal.SIGTERM)
        # While it drains, the control socket still answers and new work is refused.
        wait_until(lambda: operator.health()["state"] == "stopping", 5, message="stopping")
        with RawDealer(daemon.infer) as late:
            late.send_infer("late", "slow", _x())
            header, _ = late.recv(timeout=5)
        assert_error(header, "UNAVAILABLE", "shutting down", "late")
        replies = _collect(dealer, count, timeout=10 + count * call_s * 3)
    assert daemon.process.wait(timeout=20) == 0, daemon.log()
    ids = sorted(header["id"] for _, header in replies)
    assert ids == list(range(count))
    for _, header in replies:
        assert header["ok"] or header["error"]["code"] == "UNAVAILABLE", header
    assert any(header["ok"] for _, header in replies)


def test_sigterm_without_drain_fails_queued_requests_unavailable(
    daemon_factory: DaemonFactory, slow_model: tuple[Path, float]
) -> None:
    path, call_s = slow_model
    daemon = daemon_factory(
        models=[{"name": "slow", "path": str(path)}], daemon={"shutdown_drain_ms": 0}
    )
    count = 8
    with RawDealer(daemon.infer) as dealer:
        for request_id in range(count):
            dealer.send_infer(request_id, "slow", _x())
        _wait_queued(daemon, count - 2)
        daemon.process.send_signal(signal.SIGTERM)
        replies = _collect(dealer, count, timeout=10 + 3 * call_s)
    assert daemon.process.wait(timeout=20) == 0, daemon.log()
    by_id = {header["id"]: header for _, header in replies}
    assert sorted(by_id) == list(range(count))
    unavailable = [h for h in by_id.values() if not h["ok"]]
    # At most the running request and one the worker took meanwhile complete.
    assert len(unavailable) >= count - 3, by_id
    for header in unavailable:
        # Queued ones "shut down before this request ran"; one that arrived after
        # SIGTERM is refused at admission ("the daemon is shutting down").
        assert_error(header, "UNAVAILABLE", "shut", header["id"])
    queued_failures = [
        h for h in unavailable if "shut down before this request ran" in h["error"]["message"]
    ]
    assert len(queued_failures) >= count - 4, by_id
    assert "requests_failed_at_shutdown" in daemon.log()
