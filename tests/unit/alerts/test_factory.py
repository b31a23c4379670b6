"""The hook factory (``inferd.alerts.factory``): configured order, refusals."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from inferd import config
from inferd.alerts import FdrAlertHook, PubAlertHook, build_alert_hooks
from inferd.alerts.mavlink import MavlinkAlertHook
from inferd.config import AlertsConfig
from inferd.errors import ConfigError


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


def test_source_component_0_is_refused_at_config_load_with_the_key_named(tmp_path: Path) -> None:
    # MAV_COMP_ID_ALL: a broadcast target, "not a valid *source* component id".
    base = {"daemon": {"state_dir": str(tmp_path)}, "models": [{"name": "m", "path": "m.onnx"}]}
    for key in ("mavlink_source_component", "mavlink_source_system"):
        with pytest.raises(ConfigError, match=rf"alerts\.{key} must be 1\.\.255"):
            config.from_mapping({**base, "alerts": {key: 0}}, source="test", base_dir=tmp_path)
    loaded = config.from_mapping(
        {**base, "alerts": {"mavlink_source_component": 1}}, source="test", base_dir=tmp_path
    )
    assert loaded.alerts.mavlink_source_component == 1


def test_a_mavlink_hook_refusing_its_arguments_is_refused_not_a_crash() -> None:
    """A config that passed load (as component 0 did) never crashes the daemon's start."""
    settings = AlertsConfig(hooks=("mavlink", "pub"))
    object.__setattr__(settings, "mavlink_source_component", 0)  # as it loaded before
    refused: list[tuple[str, str]] = []
    with capture_logs() as logs:
        hooks = build_alert_hooks(
            settings,
            events=lambda *_: None,
            record=None,
            on_refused=lambda hook, reason: refused.append((hook, reason)),
        )
    for hook in hooks:
        hook.close()
    assert [type(hook) for hook in hooks] == [PubAlertHook]
    assert refused == [("mavlink", "source_component must be 1..255, got 0")]
    assert [entry["hook"] for entry in logs if entry["event"] == "alert_hook_refused"] == [
        "mavlink"
    ]
