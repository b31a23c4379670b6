"""A model on the fallback for a cause no build fixes is shown, ``skipped`` and why,
in ``status.builds.rebuilds`` and on ``inferctl status``'s ``rebuilds`` line (review
R1 of session 15, finding 1).

Before, ``FallbackRebuilder.on_fallback`` logged ``engine_rebuild_skipped`` and kept
nothing, so a daemon serving a ``tensorrt`` model on the fallback on a host without
TensorRT (``make demo``'s ``demo-trt``) said "rebuilds: none (no model fell back since
start)"."""

from __future__ import annotations

from typing import Any

from inferd.serving.rebuild import FallbackRebuilder
from inferd.types import Alert
from inferd_client import cli_format


def _rebuilder(builds: list[dict[str, Any]], can_build: bool) -> FallbackRebuilder:
    alerts: list[Alert] = []
    return FallbackRebuilder(
        start_build=lambda request: builds.append(request) or {"build_id": f"b{len(builds)}"},
        switch=lambda *_args: {},
        alert=alerts.append,
        can_build=lambda: can_build,
        backoff_s=0.0,
        max_attempts=3,
    )


def _line(rebuilder: FallbackRebuilder) -> str:
    status = {"enabled": True, "max_attempts": 3, "models": rebuilder.describe()}
    return cli_format._rebuilds_line(status)


def test_a_fallback_no_build_can_fix_here_is_shown_skipped_and_why() -> None:
    builds: list[dict[str, Any]] = []
    rebuilder = _rebuilder(builds, can_build=False)
    why = rebuilder.on_fallback("demo-trt", "tensorrt is not importable")
    assert why is not None and builds == []
    shown = rebuilder.describe()["demo-trt"]
    assert (shown["state"], shown["skipped"]) == ("skipped", why)
    assert _line(rebuilder) == f"demo-trt: no build asked for: {why}"  # before: "none (...)"
    rebuilder.operator_chose("demo-trt")  # their switch serves now: nothing skipped
    assert rebuilder.describe()["demo-trt"]["state"] == "idle"


def test_a_later_fallback_a_build_fixes_is_no_longer_skipped() -> None:
    builds: list[dict[str, Any]] = []
    rebuilder = _rebuilder(builds, can_build=True)
    assert rebuilder.on_fallback("m", "pycuda missing", "RuntimeNotAvailableError") is not None
    assert rebuilder.describe()["m"]["state"] == "skipped"
    assert rebuilder.on_fallback("m", "engine missing", "EngineMissingError") is None
    shown = rebuilder.describe()["m"]
    assert (shown["state"], shown["skipped"], len(builds)) == ("building", None, 1)
