"""The hook factory (``inferd.alerts.factory``): configured order, refusals."""

from __future__ import annotations

import socket
import sys

import pytest
from structlog.testing import capture_logs

from inferd.alerts import FdrAlertHook, PubAlertHook, build_alert_hooks
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.config import AlertsConfig


def test_factory_builds_hooks_in_configured_order(udp_listener: socket.socket) -> None:
    port = udp_listener.getsockname()[1]
    config = AlertsConfig(
        hooks=("mavlink", "fdr", "pub"), mavlink_endpoint=f"udpout:127.0.0.1:{port}"
    )
    hooks = build_alert_hooks(config, events=lambda *_: None, record=lambda *_: None)
    try:
        assert [type(hook) for hook in hooks] == [MavlinkAlertHook, FdrAlertHook, PubAlertHook]
        assert [getattr(hook, "name", None) for hook in hooks] == ["mavlink", "fdr", "pub"]
    finally:
        for hook in hooks:
            hook.close()


def test_factory_refuses_unbuildable_hooks_without_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pymavlink", None)
    refused: list[tuple[str, str]] = []
    with capture_logs() as logs:
        hooks = build_alert_hooks(
            AlertsConfig(hooks=("fdr", "mavlink", "pub")),
            events=lambda *_: None,
            record=None,
            on_refused=lambda hook, reason: refused.append((hook, reason)),
        )
    assert [type(hook) for hook in hooks] == [PubAlertHook]
    assert [hook for hook, _ in refused] == ["fdr", "mavlink"]
    assert "pymavlink is not installed" in refused[1][1]
    assert [entry["hook"] for entry in logs if entry["event"] == "alert_hook_refused"] == [
        "fdr",
        "mavlink",
    ]
