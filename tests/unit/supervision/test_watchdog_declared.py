"""Declared long operations and the watchdog, over the real sd_notify datagram
protocol (a bound socket standing in for systemd) with an injected clock: a model
load the engine worker declared keeps the pings going within its bound while
``STATUS=`` says what is waited for; past the bound, or silent without a
declaration, the pings stop and the stall is logged and recorded in the FDR."""

from __future__ import annotations

import socket
from typing import Any

from structlog.testing import capture_logs

from inferd.supervision.notify import Notifier
from inferd.supervision.watchdog import (
    STARTUP_GRACE_S,
    WITHHELD_RECORD,
    Watchdog,
    WatchdogSettings,
    startup_extension_s,
)
from inferd.types import DeclaredOperation, Liveness

S = 1_000_000_000  # ns
LOAD = "loading demo (onnx_trt_ep)"


class Clock:
    def __init__(self) -> None:
        self.now = 1000 * S

    def __call__(self) -> int:
        return self.now


class Daemonish:
    """The main loop's side: tick the watchdog, then send STATUS= as cli.main does."""

    def __init__(self, receiver: tuple[socket.socket, str], clock: Clock) -> None:
        self.sock, address = receiver
        self.clock = clock
        self.lines: list[str] = []
        self.notifier = Notifier(address)  # the built-in datagram sender
        self.records: list[tuple[str, dict[str, Any]]] = []
        self.threads: dict[str, Liveness] = {
            "engine_worker": Liveness(clock.now),
            "bus": Liveness(clock.now),
        }
        self.watchdog = Watchdog(
            self.notifier,
            WatchdogSettings(interval_s=4.0),  # pings every 2 s, silence limit 2 s
            lambda: dict(self.threads),
            record=lambda kind, payload: self.records.append((kind, dict(payload))),
            clock=clock,
        )

    def run_for(self, seconds: float, step_s: float = 0.5, *, ready: bool = True) -> None:
        """Advance the clock in main-loop ticks; the bus beats, the worker does not."""
        for _ in range(round(seconds / step_s)):
            self.clock.now += int(step_s * S)
            self.threads["bus"] = Liveness(self.clock.now)
            self.watchdog.tick(ready=ready)
            fragment = self.watchdog.describe()
            self.notifier.status(f"serving: demo=onnx_trt_ep | {fragment}" if fragment else "ok")
            self.drain()  # a datagram socket queues only a few (net.unix.max_dgram_qlen)

    def drain(self) -> None:
        """Take every datagram queued on the receiver (each arrives as it is sent)."""
        self.sock.setblocking(False)
        while True:
            try:
                self.lines += self.sock.recv(65536).decode().split("\n")
            except BlockingIOError:
                return

    def received(self) -> list[str]:
        self.drain()
        lines, self.lines = self.lines, []
        return lines


def test_a_declared_load_keeps_the_pings_within_its_bound_then_stops_them(
    receiver: tuple[socket.socket, str],
) -> None:
    clock = Clock()
    main = Daemonish(receiver, clock)
    main.run_for(1)
    operation = DeclaredOperation(LOAD, clock.now, allowed_s=30.0)
    main.threads["engine_worker"] = Liveness(clock.now, operation)
    with capture_logs() as logs:
        main.run_for(29)  # 29 s into a 30 s bound: the worker has not beaten since it began
    during = main.received()
    assert during.count("WATCHDOG=1") >= 14  # every 2 s, as if the worker beat
    assert (
        "STATUS=serving: demo=onnx_trt_ep | waiting: engine_worker " + LOAD + " 12 s of 30 s"
        in (during)
    )
    assert [entry["event"] for entry in logs] == ["watchdog_waiting_for"]
    assert main.records == []

    with capture_logs() as logs:
        main.run_for(10)  # past the bound
    after = main.received()
    assert "WATCHDOG=1" not in after[2:]  # at most the ping due at 30 s, none after
    assert (
        "STATUS=serving: demo=onnx_trt_ep | watchdog withheld: engine_worker "
        f"{LOAD} overran its 30 s bound (30.5 s)"
    ) in after
    withheld = [entry for entry in logs if entry["event"] == "watchdog_pings_withheld"]
    assert len(withheld) == 1 and withheld[0]["log_level"] == "error"
    assert withheld[0]["stalled"] == {
        "engine_worker": f"engine_worker {LOAD} overran its 30 s bound (30.5 s)"
    }
    ((kind, payload),) = main.records
    assert kind == WITHHELD_RECORD and payload["watchdog_s"] == 4.0
    assert payload["threads"]["engine_worker"]["reason"] == "overran"
    assert payload["threads"]["engine_worker"]["operation"] == LOAD
    assert payload["threads"]["engine_worker"]["allowed_s"] == 30.0

    # The load finishes after all: the worker beats again and the pings resume.
    main.threads["engine_worker"] = Liveness(clock.now)
    with capture_logs() as logs:
        main.run_for(0.5)
    assert "WATCHDOG=1" in main.received()
    assert [entry["event"] for entry in logs] == ["watchdog_pings_resumed"]


def test_an_undeclared_stall_is_reported_and_recorded(receiver: tuple[socket.socket, str]) -> None:
    clock = Clock()
    main = Daemonish(receiver, clock)
    with capture_logs() as logs:
        main.run_for(6)  # an inference that does not return
    lines = main.received()
    assert lines.count("WATCHDOG=1") == 1  # at 0.5 s; the worker went silent after 2 s
    assert any(
        line.startswith(
            "STATUS=serving: demo=onnx_trt_ep | watchdog withheld: engine_worker silent"
        )
        for line in lines
    )
    assert [entry["event"] for entry in logs] == ["watchdog_pings_withheld"]
    ((kind, payload),) = main.records
    assert kind == WITHHELD_RECORD
    assert payload["threads"] == {
        "engine_worker": {
            "reason": "silent",
            "silent_s": 2.5,
            "operation": None,
            "elapsed_s": None,
            "allowed_s": None,
        }
    }


def test_before_ready_it_reports_but_never_pings(receiver: tuple[socket.socket, str]) -> None:
    """systemd arms its watchdog at READY=1; during start-up a declared load gets
    start time instead (EXTEND_TIMEOUT_USEC for its bound plus a grace)."""
    clock = Clock()
    main = Daemonish(receiver, clock)
    operation = DeclaredOperation(LOAD, clock.now, allowed_s=900.0)
    main.threads["engine_worker"] = Liveness(clock.now, operation)
    extend_s = startup_extension_s(main.threads, clock.now, minimum_s=300.0)
    assert extend_s == 900.0 + STARTUP_GRACE_S
    main.notifier.extend_timeout(extend_s)
    main.run_for(3, ready=False)
    lines = main.received()
    assert lines[0] == f"EXTEND_TIMEOUT_USEC={int((900 + STARTUP_GRACE_S) * 1e6)}"
    assert "WATCHDOG=1" not in lines
    assert f"STATUS=serving: demo=onnx_trt_ep | waiting: engine_worker {LOAD} 3 s of 900 s" in lines
    clock.now += 600 * S
    assert startup_extension_s(main.threads, clock.now, minimum_s=300.0) == 297.0 + STARTUP_GRACE_S
    assert startup_extension_s({"bus": Liveness(clock.now)}, clock.now, 300.0) == 300.0


def test_at_ready_status_no_longer_says_it_waits_for_the_load(
    receiver: tuple[socket.socket, str],
) -> None:
    """The first tick after READY=1 re-reads the threads: a load that ended with
    start-up is not still shown as waited for until the next scheduled check."""
    clock = Clock()
    main = Daemonish(receiver, clock)
    main.threads["engine_worker"] = Liveness(clock.now, DeclaredOperation(LOAD, clock.now, 900.0))
    main.run_for(1, ready=False)
    assert any("waiting: engine_worker" in line for line in main.received())
    main.threads["engine_worker"] = Liveness(clock.now)  # loaded: the worker beats again
    main.run_for(0.01, step_s=0.01)  # the main loop's first tick, just after READY=1
    lines = main.received()
    assert "WATCHDOG=1" in lines
    assert [line for line in lines if line.startswith("STATUS=")] == ["STATUS=ok"]
