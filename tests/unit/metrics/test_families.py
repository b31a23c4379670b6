"""``inferd.metrics.families``: a ``status`` document as metric families, read
back with prometheus_client's own parser."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inferd.metrics import families
from inferd.serving.stats import ModelStats


def status(**overrides: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "daemon": {
            "version": "0.1.0",
            "state": "degraded",
            "uptime_s": 12.5,
            "config_fingerprint": "0123456789abcdef",
        },
        "models": [
            {
                "model": "det",
                "state": "serving",
                "configured_runtime": "tensorrt",
                "runtime": "onnx_trt_ep",
                "fallback": True,
                "queue_depth": 3,
                "queue_capacity": 64,
                "queue_bytes": 1024,
                "queue_max_bytes": 4096,
                "requests": 10,
                "responses": {"OK": 8, "RESOURCE_EXHAUSTED": 2},
                "late_results": 1,
            }
        ],
        "bus": {
            "malformed": 4,
            "oversized_messages": 1,
            "events_published": 100,
            "events_dropped": 0,
            "replies": {
                "dropped": 2,
                "in_flight_bytes": 512,
                "graces": {
                    "waited": 7,
                    "ran_out": 5,
                    "held_off": {"peer_budget": 3, "total_budget": 1},
                    "waited_s": 0.105,
                },
            },
            "busy_poll": {"us": 50, "caught": 90, "missed": 10, "spent_us": 2_500_000},
        },
        "fdr": {
            "enabled": True,
            "records_written": 20,
            "records_dropped": 3,
            "bytes_written": 4000,
            "queue_depth": 0,
            "queue_bytes": 0,
            "segments_deleted": 0,
            "segments_kept": 2,
            "bytes_kept": 6144,
            "max_total_bytes": 8192,
            "oldest_segment": "seg-0000000004.fdr",
        },
        "alerts": {
            "raised": 5,
            "sent": 3,
            "suppressed": 2,
            "hooks": {"pub": {"sent": 3, "failures": 0, "last_error": None}},
        },
        "thermal": {
            "source": "nvml",
            "available": True,
            "throttle_active": False,
            "threshold_c": 90.0,
            "last_reading": {
                "cpu_temp_c": None,
                "gpu_temp_c": 61.0,
                "clock_mhz": 1305.0,
                "gpu_utilization_pct": 37.0,
                "gpu_memory_used_bytes": 1024**3,
                "gpu_memory_total_bytes": None,
                "gpu_power_w": 61.25,
            },
        },
        "security": {
            "sockets": {
                "infer": {"connections_refused": 0, "connections": 3},
                "control": {"connections_refused": 2, "connections": 1},
                "events": {"connections_refused": 0, "connections": 0},
            },
            "max_connections": 256,
            "permission_denied": 1,
            "switch_limit": {"burst": 10, "refill_s": 6.0, "refused": 0},
            "descriptor_guard": {
                "limit": 65536,
                "threshold": 8192,
                "period_s": 0.1,
                "episodes": 0,
                "connections_ended": 0,
                "share_level": 16384,
                "share_target": 8192,
                "share_passes": 0,
                "connections_ended_past_share": 0,
            },
        },
        "builds": {
            "start_refused": {},
            "start_limit": {"burst": 2, "refill_s": 30.0, "refused": 0},
            "running_limit": {"max_running": 2, "running": 1, "refused": 0},
            "rebuilds": {"enabled": False, "models": {}},
        },
    }
    document.update(overrides)
    return document


#: ``status.shm`` with shared memory enabled.
SHM: dict[str, Any] = {
    "enabled": True,
    "connections": 2,
    "connections_by_uid": {"1000": 2},
    "max_connections_per_uid": 8,
    "refused_per_uid": 0,
    "refused_by_uid": {},
    "mapped_bytes": 8 << 20,
    "releasing_bytes": 1 << 20,
    "requests": 40,
    "in_flight": 1,
    "unroutable_replies": 3,
    "closed_not_reading": 1,
    "refused": {},
    "closing": {
        "waiting": 5,
        "closed": 9,
        "blocked_s": 2.5,
        "connections_closed_for_backlog": 1,
    },
}


def scrape(document: dict[str, Any], stats: ModelStats | None = None) -> dict[Any, float]:
    class Collector:
        def collect(self) -> Any:
            return families.collect(document, {"det": stats.latency_histogram()} if stats else {})

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_models_state_and_counters() -> None:
    stats = ModelStats()
    for latency_us in (800, 3_000, 3_000_000):
        stats.answered("OK", latency_us)
    got = scrape(status(), stats)
    det = (("model", "det"),)
    assert got[("inferd_requests_total", det)] == 10
    assert got[("inferd_responses_total", (("code", "OK"), *det))] == 8
    assert got[("inferd_responses_total", (("code", "RESOURCE_EXHAUSTED"), *det))] == 2
    assert got[("inferd_responses_total", (("code", "INTERNAL"), *det))] == 0
    assert got[("inferd_late_results_total", det)] == 1
    assert got[("inferd_model_fallback", det)] == 1
    assert got[("inferd_queue_depth", det)] == 3 and got[("inferd_queue_bytes", det)] == 1024
    runtime = (("configured_runtime", "tensorrt"), ("model", "det"))
    assert got[("inferd_model_runtime", (*runtime, ("runtime", "onnx_trt_ep")))] == 1
    assert got[("inferd_model_runtime", (*runtime, ("runtime", "tensorrt")))] == 0
    assert got[("inferd_daemon_state", (("state", "degraded"),))] == 1
    assert got[("inferd_daemon_state", (("state", "serving"),))] == 0
    bucket = "inferd_request_duration_seconds_bucket"
    assert got[(bucket, (("le", "0.001"), *det))] == 1
    assert got[(bucket, (("le", "0.005"), *det))] == 2
    assert got[(bucket, (("le", "2.5"), *det))] == 2
    assert got[(bucket, (("le", "+Inf"), *det))] == 3
    assert got[("inferd_request_duration_seconds_count", det)] == 3
    assert abs(got[("inferd_request_duration_seconds_sum", det)] - 3.0038) < 1e-9
    assert got[("inferd_fdr_records_dropped_total", ())] == 3
    assert got[("inferd_bus_busy_poll_seconds_total", ())] == 2.5
    assert got[("inferd_connections_refused_total", (("socket", "control"),))] == 2
    assert got[("inferd_connections", (("socket", "infer"),))] == 3
    assert got[("inferd_max_connections", ())] == 256


def test_the_reply_budgets_release_graces_are_counted_by_kind() -> None:
    """What the sender's graces cost (DESIGN.md 251, 280), from ``bus.replies.graces``."""
    got = scrape(status())
    assert got[("inferd_bus_reply_graces_total", ())] == 7
    assert got[("inferd_bus_reply_graces_ran_out_total", ())] == 5
    held_off = "inferd_bus_reply_graces_held_off_total"
    assert got[(held_off, (("reason", "peer_budget"),))] == 3
    assert got[(held_off, (("reason", "total_budget"),))] == 1
    assert got[("inferd_bus_reply_grace_wait_seconds_total", ())] == 0.105


def test_gpu_readings_in_base_units_and_absent_when_not_reported() -> None:
    got = scrape(status())
    nvml = (("source", "nvml"),)
    assert got[("inferd_gpu_temperature_celsius", nvml)] == 61.0
    assert got[("inferd_gpu_clock_hertz", nvml)] == 1305e6
    assert got[("inferd_gpu_utilization_ratio", nvml)] == 0.37
    assert got[("inferd_gpu_memory_used_bytes", nvml)] == 1024**3
    assert got[("inferd_gpu_power_watts", nvml)] == 61.25
    names = {name for name, _ in got}
    assert "inferd_cpu_temperature_celsius" not in names  # NVML has no CPU sensor
    assert "inferd_gpu_memory_total_bytes" not in names


def test_no_telemetry_and_no_recorder_leave_only_their_flags() -> None:
    thermal = {**status()["thermal"], "available": False}
    got = scrape(status(thermal=thermal, fdr={"enabled": False, "error": "disabled"}))
    assert got[("inferd_thermal_telemetry_available", ())] == 0
    assert got[("inferd_fdr_enabled", ())] == 0
    names = {name for name, _ in got}
    assert not {n for n in names if n.startswith(("inferd_gpu_", "inferd_fdr_records"))}


def test_what_the_recorder_keeps_is_required_while_it_runs() -> None:
    got = scrape(status())
    assert got[("inferd_fdr_segments_kept", ())] == 2
    assert got[("inferd_fdr_kept_bytes", ())] == 6144
    assert got[("inferd_fdr_max_total_bytes", ())] == 8192
    # Required, as the schema requires them: a status without one is a bug, and the
    # exporter leaves the fdr section out and counts it rather than serve it in part.
    for key in ("segments_kept", "bytes_kept", "max_total_bytes"):
        fdr = {name: value for name, value in status()["fdr"].items() if name != key}
        with pytest.raises(KeyError, match=key):
            families.collect(status(fdr=fdr), {})


def test_shared_memory_when_enabled_and_nothing_when_off() -> None:
    samples = scrape(status(shm=SHM))
    assert samples[("inferd_shm_connections", ())] == 2
    assert samples[("inferd_shm_mapped_bytes", ())] == 8 << 20
    assert samples[("inferd_shm_releasing_bytes", ())] == 1 << 20
    assert samples[("inferd_shm_requests_total", ())] == 40
    assert samples[("inferd_shm_requests_in_flight", ())] == 1
    assert samples[("inferd_shm_unroutable_replies_total", ())] == 3
    assert samples[("inferd_shm_closed_not_reading_total", ())] == 1
    assert samples[("inferd_shm_descriptors_closing", ())] == 5
    assert samples[("inferd_shm_close_blocked_seconds", ())] == 2.5
    assert samples[("inferd_shm_closed_for_backlog_total", ())] == 1
    off = scrape(status(shm={"enabled": False}))
    assert not any(name.startswith("inferd_shm_") for name, _ in off)


def test_every_family_is_in_the_operations_guides_metrics_table() -> None:
    """An operator finds each family the exporter serves in docs/OPERATIONS.md."""
    document = status()
    document["builds"]["rebuilds"] = {
        "enabled": True,
        "max_attempts": 3,
        "backoff_s": 60.0,
        "models": {"det": {"state": "building", "attempts": 1}},
    }
    names = {metric.name for metric in families.collect(document, {})}
    guide = (Path(__file__).parents[3] / "docs" / "OPERATIONS.md").read_text()
    table = [line.split("|")[1] for line in guide.splitlines() if line.startswith("| `inferd_")]
    rows = {name for cell in table for name in re.findall(r"`(inferd_[a-z_]+)`", cell)}
    undocumented = {n for n in names if n not in rows and f"{n}_total" not in rows}
    assert len(names) > 60 and undocumented == set()
