"""``inferctl top``'s state and screen without a terminal: rates from successive
snapshots, build phases and alerts from events, and a layout that fits."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from inferd_client.top import TopState, render


def status(requests: int, **model: Any) -> dict[str, Any]:
    return {
        "daemon": {"version": "0.1.0", "pid": 42, "state": "degraded", "uptime_s": 3725.2},
        "thermal": {
            "available": True,
            "source": "nvml",
            "throttle_active": True,
            "last_reading": {"gpu_temp_c": 88.5, "gpu_utilization_pct": 97.0, "gpu_power_w": 61.3},
        },
        "models": [
            {
                "model": "detector",
                "state": "serving",
                "runtime": "onnx_trt_ep",
                "configured_runtime": "tensorrt",
                "fallback": True,
                "requests": requests,
                "responses": {"OK": requests - 3, "RESOURCE_EXHAUSTED": 2, "INTERNAL": 1},
                "latency_us": {"window": 10, "p50": 1500, "p99": 12345},
                "queue_depth": 7,
                "queue_capacity": 64,
                **model,
            }
        ],
    }


def screen(state: TopState, width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(render(state, "ipc:///run/inferd/control.sock", 1.0, now=100.0))
    return console.export_text()


def test_rate_is_the_difference_of_two_snapshots() -> None:
    state = TopState()
    state.on_status(status(100), [], at=10.0)
    assert state.rates == {}  # one snapshot: no rate yet
    state.on_status(status(150), [], at=12.0)
    assert state.rates == {"detector": 25.0}
    state.on_unreachable("no reply")
    state.on_status(status(3), [], at=20.0)  # a restarted daemon counts from 0 again
    assert state.rates == {}


def test_screen_shows_state_fallback_errors_latency_builds_and_alerts() -> None:
    state = TopState()
    state.on_status(status(100), [], at=10.0)
    state.on_status(
        status(150),
        [
            {
                "build_id": "b7-1a2b3c",
                "model": "detector",
                "builder": "tensorrt",
                "state": "running",
                "elapsed_s": 42.5,
            }
        ],
        at=12.0,
    )
    state.on_event(
        "build", {"buildId": "b7-1a2b3c", "name": "build_engine", "step": 2, "numSteps": 9}
    )
    state.on_event(
        "alert",
        {"ts_ns": 0, "level": "WARNING", "code": "fallback_to_onnx_trt_ep", "message": "fell"},
    )
    text = screen(state, 120)
    assert "inferd 0.1.0  pid 42  degraded  up 1:02:05  THROTTLING (nvml) gpu 88.5°C" in text
    assert "load 97% 61.3 W" in text
    row = next(line for line in text.splitlines() if line.lstrip().startswith("detector"))
    for cell in ("serving", "onnx_trt_ep (fallback)", "25.0", "150", "147"):
        assert cell in row
    assert "INTERNAL 1, RESOURCE_EXHAUSTED 2" in row
    assert "1.50" in row and "12.35" in row and "7/64" in row
    assert "b7-1a2b3c" in text and "build_engine 3/9" in text and "42.5" in text
    assert "fallback_to_onnx_trt_ep" in text


def test_an_80_column_terminal_keeps_every_heading() -> None:
    state = TopState()
    state.on_status(status(100), [], at=10.0)
    text = screen(state, 80)
    header = next(line for line in text.splitlines() if "MODEL" in line)
    for heading in ("MODEL", "STATE", "RUNTIME", "REQ/S", "REQUESTS", "OK", "ERRORS", "QUEUE"):
        assert heading in header
    assert "P50 ms" in header and "P99 ms" in header
    assert all(len(line) <= 80 for line in text.splitlines())


def test_unreachable_daemon_is_said_and_the_last_state_kept() -> None:
    state = TopState()
    state.on_status(status(5), [], at=90.0)
    state.on_unreachable("no reply from ipc:///run/inferd/control.sock within 1.000s")
    text = " ".join(screen(state, 120).split())
    assert "daemon unreachable: no reply" in text and "last answer 10 s ago" in text
    assert "models (last known" in text and "detector" in text


SHM = {
    "enabled": True,
    "thread_alive": True,
    "connections": 3,
    "max_connections": 16,
    "regions": [{"id": "ab12…", "nbytes": 50331648}, {"id": "cd34…", "nbytes": 16777216}],
    "mapped_bytes": 67108864,
    "max_bytes_total": 1073741824,
    "in_flight": 2,
    "refused": {},
    "unroutable_replies": 0,
}


def test_the_shared_memory_line_shows_connections_regions_and_mapped_bytes() -> None:
    state = TopState()
    state.on_status({**status(10), "shm": SHM}, [], at=10.0)
    text = screen(state, 120)
    line = next(line for line in text.splitlines() if line.startswith("shared memory"))
    assert "3/16 connections" in line and "2 regions" in line
    assert "64.0 of 1024 MiB mapped" in line and "2 in flight" in line
    assert "refused" not in line and "gone" not in line and "DOWN" not in line
    troubled = {
        **SHM,
        "refused": {"RESOURCE_EXHAUSTED": 4, "INVALID_ARGUMENT": 1},
        "unroutable_replies": 7,
        "thread_alive": False,
    }
    state.on_status({**status(20), "shm": troubled}, [], at=11.0)
    line = next(line for line in screen(state, 160).splitlines() if "shared memory" in line)
    assert "5 refused" in line and "7 replies to gone clients" in line
    assert "registration thread DOWN" in line
    state.on_status({**status(30), "shm": {"enabled": False}}, [], at=12.0)
    assert "shared memory off" in screen(state, 120)
