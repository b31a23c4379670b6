"""structlog event -> journal fields (``inferd.supervision.journal_fields``):
event names and message ids, field names, priorities, alerts, tracebacks."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from inferd.supervision.journal_fields import (
    MESSAGE_ID_NAMESPACE,
    field_name,
    journal_fields,
    message_id,
)
from tests.unit.supervision.conftest import as_dict

pytestmark = pytest.mark.systemd


FIELD_RULE = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")  # journald's journal_field_valid, client side


def test_event_names_and_message_ids() -> None:
    expected = uuid.uuid5(MESSAGE_ID_NAMESPACE, "fallback_to_onnx_trt_ep").hex
    assert message_id("fallback_to_onnx_trt_ep") == expected
    assert re.fullmatch(r"[0-9a-f]{32}", expected)
    assert message_id("daemon_ready") != expected
    # Stable across releases: pinned.
    assert message_id("daemon_ready") == "0e7b662feb9f5c319e7a9682bccceded"


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("model_sha256", "INFERD_MODEL_SHA256"),
        ("alert-fields.x", "INFERD_ALERT_FIELDS_X"),
        ("späť", "INFERD_SP__"),
        ("9lives", "INFERD_9LIVES"),
        ("_private", "INFERD__PRIVATE"),
    ],
)
def test_field_names_follow_journald_rules(key: str, name: str) -> None:
    assert field_name(key) == name
    assert FIELD_RULE.match(name)


def test_long_field_names_are_cut_to_64() -> None:
    name = field_name("k" * 200)
    assert len(name) == 64 and FIELD_RULE.match(name)


def test_fields_of_a_failover_warning() -> None:
    fields = journal_fields(
        {
            "event": "fallback_to_onnx_trt_ep",
            "level": "warning",
            "model": "det",
            "runtime": "onnx_trt_ep",
            "build_id": "b-17",
            "alert_code": "fallback_to_onnx_trt_ep",
            "fallback": True,
            "active_providers": ["CPUExecutionProvider"],
            "reason": None,
            "latency_ms": 1.5,
            "path": Path("/var/lib/inferd/engines"),
            "pathname": "/src/runtime.py",
            "lineno": 42,
            "func_name": "infer",
            "thread_name": "inferd-engine-worker",
            "timestamp": "2026-01-01T00:00:00Z",
        }
    )
    got = as_dict(fields)
    assert got["PRIORITY"] == ["4"]
    assert got["SYSLOG_IDENTIFIER"] == ["inferd"]
    assert got["MESSAGE_ID"] == [message_id("fallback_to_onnx_trt_ep")]
    assert got["INFERD_EVENT"] == ["fallback_to_onnx_trt_ep"]
    assert got["INFERD_MODEL"] == ["det"]
    assert got["INFERD_RUNTIME"] == ["onnx_trt_ep"]
    assert got["INFERD_BUILD_ID"] == ["b-17"]
    assert got["INFERD_CODE"] == ["fallback_to_onnx_trt_ep"]
    assert got["INFERD_FALLBACK"] == ["true"]
    assert got["INFERD_ACTIVE_PROVIDERS"] == ['["CPUExecutionProvider"]']
    assert got["INFERD_LATENCY_MS"] == ["1.5"]
    assert got["INFERD_PATH"] == ["/var/lib/inferd/engines"]
    assert got["INFERD_THREAD_NAME"] == ["inferd-engine-worker"]
    assert got["CODE_FILE"] == ["/src/runtime.py"]
    assert got["CODE_LINE"] == ["42"]
    assert got["CODE_FUNC"] == ["infer"]
    assert "INFERD_REASON" not in got  # None carries nothing
    assert "INFERD_TIMESTAMP" not in got and "INFERD_LEVEL" not in got  # journald's own
    assert got["MESSAGE"][0].startswith("fallback_to_onnx_trt_ep model=det runtime=onnx_trt_ep")
    for key, _ in fields:
        assert FIELD_RULE.match(key), key


@pytest.mark.parametrize(
    ("level", "priority"),
    [("debug", "7"), ("info", "6"), ("warning", "4"), ("error", "3"), ("critical", "2")],
)
def test_priorities(level: str, priority: str) -> None:
    assert as_dict(journal_fields({"event": "x", "level": level}))["PRIORITY"] == [priority]


def test_alert_fields_are_lifted_and_codes_kept_verbatim() -> None:
    got = as_dict(
        journal_fields(
            {
                "event": "alert",
                "level": "warning",
                "alert_code": "model_unavailable",
                "alert_fields": {"model": "seg", "runtime": "tensorrt"},
            }
        )
    )
    assert got["INFERD_EVENT"] == ["alert"]
    assert got["INFERD_CODE"] == ["model_unavailable"]
    assert got["INFERD_MODEL"] == ["seg"] and got["INFERD_RUNTIME"] == ["tensorrt"]
    assert got["INFERD_ALERT_FIELDS"] == ['{"model":"seg","runtime":"tensorrt"}']


def test_traceback_stays_in_one_multiline_message() -> None:
    fields = journal_fields(
        {"event": "inference_crashed", "level": "error", "exception": "Traceback...\nBoom\n"}
    )
    got = as_dict(fields)
    assert got["MESSAGE"] == ["inference_crashed\nTraceback...\nBoom"]
    assert "INFERD_EXCEPTION" not in got
