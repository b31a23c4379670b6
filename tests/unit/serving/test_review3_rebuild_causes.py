"""A model on the fallback for a cause no build fixes asks for no background build, and
a rebuilt engine its runtime refuses for such a cause is not rebuilt (review D, F3:
``serving/rebuild.py`` ``on_fallback``, ``_adopt``; ``serving/slot.py``
``fallback_cause``, ``BUILD_FIXES``; ``daemon.py`` ``_rebuild_if_fallback`` and
``can_build``).

Before: every ``tensorrt`` model on the fallback was rebuilt, whatever the cause, and a
rebuilt engine refused at adoption (TensorRT disabled by ``runtime.enabled``, the GPU
memory budget) was counted as a failed build and built again: 3 builds, two
``engine_build_failed`` WARNING alerts and one ``engine_build_gave_up`` ERROR."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import structlog

from inferd import config as config_module
from inferd.config import ModelConfig, RuntimeConfig
from inferd.daemon import Daemon
from inferd.engine_build.supervisor import BuildManager
from inferd.errors import (
    EngineDeserializeError,
    EngineHashMismatchError,
    EngineMissingError,
    InferdError,
    OutOfMemoryError,
    RuntimeNotAvailableError,
)
from inferd.serving.rebuild import FallbackRebuilder
from inferd.serving.slot import BUILD_FIXES, ModelSlot, Sinks
from inferd.types import EngineHandle, Peer, ThermalState
from tests.conftest import HANG_S, render_config
from tests.tensorrt_bench import Bench
from tests.unit.serving.test_execution_failover import Finished
from tests.unit.serving.test_review_switch_rebuild import (  # noqa: F401  (the fixture)
    SPEC,
    Released,
    Rig,
    rig,
)

BUDGET = OutOfMemoryError(
    "engine m.engine needs about 900.0 MiB (its file size) but 3500.0 MiB of the 4096.0 MiB "
    "GPU memory budget (runtime.gpu_memory_budget_bytes) is held by 3 resident engine(s)"
)
#: What a ``tensorrt`` preparation raises where no build helps, and where one does.
NOT_FIXED_BY_A_BUILD: dict[str, Exception] = {
    "disabled": RuntimeNotAvailableError("tensorrt", "disabled by runtime.enabled"),
    "no_pycuda": RuntimeNotAvailableError("tensorrt", "pycuda.driver cannot be imported"),
    "no_device": RuntimeNotAvailableError("tensorrt", "CUDA device 0 cannot be opened (x)"),
    "budget": BUDGET,
}
FIXED_BY_A_BUILD: dict[str, Exception] = {
    "missing": EngineMissingError("no engine for this host in /e (expected m.engine)"),
    "refused": EngineHashMismatchError("digest differs from its sidecar", stage="sidecar"),
    "unloadable": EngineDeserializeError("engine m.engine could not be deserialized: x"),
}


def preparing(refusal: Exception) -> Any:
    """A ``ModelSlot.prepare`` whose ``tensorrt`` raises ``refusal`` and whose
    ``onnx_trt_ep`` loads (as the real one's contract: only these two kinds raise)."""
    ids = iter(range(10, 100))

    def prepare(
        label: str, _config: RuntimeConfig, _sinks: Any, is_fallback: bool = False
    ) -> tuple[Any, EngineHandle]:
        if label == "tensorrt":
            raise refusal
        return Released(), EngineHandle(
            next(ids), label, "0" * 64, SPEC, SPEC, is_fallback=is_fallback
        )

    return prepare


def activated_on_the_fallback(rig: Rig, refusal: Exception) -> None:  # noqa: F811
    """``rig``'s model activated as the daemon does: its ``tensorrt`` refused."""
    rig.slot.prepare = preparing(refusal)  # type: ignore[method-assign]
    rig.slot.activate(RuntimeConfig(), rig.switcher._sinks)
    assert rig.slot.state == "serving" and rig.slot.is_fallback


def rebuild_if_fallback(rebuilder: FallbackRebuilder | None, slot: ModelSlot) -> str | None:
    """The daemon's own ``_rebuild_if_fallback`` (what activation and failover call)."""
    daemon = cast(Daemon, SimpleNamespace(rebuilder=rebuilder))
    return Daemon._rebuild_if_fallback(daemon, slot)


@pytest.mark.parametrize("cause", sorted(NOT_FIXED_BY_A_BUILD))
def test_a_fallback_no_build_fixes_asks_for_no_build_and_says_why_once(
    rig: Rig,  # noqa: F811
    cause: str,
) -> None:
    refusal = NOT_FIXED_BY_A_BUILD[cause]
    activated_on_the_fallback(rig, refusal)
    with structlog.testing.capture_logs() as logs:
        why = rebuild_if_fallback(rig.rebuilder, rig.slot)

    assert rig.builds == []  # before: one build, then two retries
    assert rig.alerts == []  # no engine_build_failed / engine_build_gave_up to come
    assert rig.rebuilder.describe().get("m", {}).get("retry_scheduled") in (None, False)
    (line,) = [line for line in logs if line["event"] == "engine_rebuild_skipped"]
    assert line["log_level"] == "warning" and line["model"] == "m"
    assert line["cause"] == type(refusal).__name__
    assert "no build fixes why it fell back" in line["reason"]
    assert str(refusal) in line["reason"]
    assert why == line["reason"]  # what a failover's alert would say
    assert rig.slot.last_error == str(refusal)  # status still says why it fell back
    shown = rig.rebuilder.describe()["m"]  # before: absent, "no model fell back"
    assert (shown["state"], shown["skipped"], shown["attempts"]) == ("skipped", why, 0)


@pytest.mark.parametrize("cause", sorted(FIXED_BY_A_BUILD))
def test_a_fallback_a_build_fixes_still_asks_for_one(rig: Rig, cause: str) -> None:  # noqa: F811
    """The rule's other side: missing, refused by the gate, or failing at load."""
    activated_on_the_fallback(rig, FIXED_BY_A_BUILD[cause])
    assert rig.slot.fallback_cause == type(FIXED_BY_A_BUILD[cause]).__name__

    assert rebuild_if_fallback(rig.rebuilder, rig.slot) is None

    assert [build["model"] for build in rig.builds] == ["m"]


@pytest.mark.parametrize("cause", ["no_device", "budget"])
def test_a_rebuilt_engine_refused_for_a_cause_no_build_fixes_is_not_rebuilt(
    rig: Rig,  # noqa: F811
    cause: str,
) -> None:
    """The model fell back because its engine was missing (a build fixes that); the
    build completes, but the adoption's preparation is refused for a cause no build
    fixes (the budget taken by other models meanwhile, the device lost): one build,
    ``engine_build_not_adopted`` (WARNING), no retry.  Before: ``engine_build_failed``
    and a retry after the backoff, up to ``rebuild_max_attempts`` builds."""
    activated_on_the_fallback(rig, FIXED_BY_A_BUILD["missing"])
    assert rebuild_if_fallback(rig.rebuilder, rig.slot) is None
    rig.slot.prepare = preparing(NOT_FIXED_BY_A_BUILD[cause])  # type: ignore[method-assign]

    with structlog.testing.capture_logs() as logs:
        rig.rebuilder.on_build_finished(Finished("b1", model="m"))

    assert [(alert.level, alert.code) for alert in rig.alerts] == [
        ("WARNING", "engine_build_not_adopted")
    ]
    assert str(NOT_FIXED_BY_A_BUILD[cause]) in rig.alerts[0].message
    assert "it is not rebuilt" in rig.alerts[0].message
    assert rig.rebuilder.describe()["m"]["retry_scheduled"] is False
    assert len(rig.builds) == 1
    (line,) = [line for line in logs if line["event"] == "engine_rebuild_adoption_abandoned"]
    assert line["build_id"] == "b1"
    assert type(NOT_FIXED_BY_A_BUILD[cause]).__name__ in line["reason"]
    assert rig.slot.is_fallback  # still serving, on the fallback


def test_a_rebuilt_engine_refused_for_a_cause_a_build_fixes_is_rebuilt(
    rig: Rig,  # noqa: F811
) -> None:
    """The other side: an engine TensorRT cannot deserialise is a failed build, retried."""
    activated_on_the_fallback(rig, FIXED_BY_A_BUILD["missing"])
    assert rebuild_if_fallback(rig.rebuilder, rig.slot) is None
    rig.slot.prepare = preparing(FIXED_BY_A_BUILD["unloadable"])  # type: ignore[method-assign]

    rig.rebuilder.on_build_finished(Finished("b1", model="m"))

    assert [alert.code for alert in rig.alerts] == ["engine_build_failed"]
    assert "could not be adopted" in rig.alerts[0].message


def test_a_daemon_whose_config_leaves_tensorrt_out_builds_no_engine(
    short_tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's case 1 end to end, in process: a model configured ``tensorrt`` with
    ``runtime.enabled = ["onnx_trt_ep"]`` (the config accepts it: a fallback is enabled)
    on a host where TensorRT could build.  It serves on the fallback, no build is asked
    for, and the log says why once.  Before: a build at start, refused at adoption,
    then two more."""
    monkeypatch.setattr(BuildManager, "tensorrt_available", lambda _self: True)
    models: list[dict[str, object]] = [
        {"name": "demo", "path": str(demo_model), "runtime": "tensorrt"}
    ]
    text = render_config(short_tmp_path, models, runtime={"enabled": ["onnx_trt_ep"]})
    (short_tmp_path / "inferd.toml").write_text(text)
    daemon = Daemon(config_module.load(short_tmp_path / "inferd.toml"))
    asked: list[dict[str, Any]] = []

    def start(header: dict[str, Any], _peer: Peer) -> dict[str, Any]:
        asked.append(header)
        return {"build_id": f"b{len(asked)}"}

    monkeypatch.setattr(daemon.builds, "start", start)
    with structlog.testing.capture_logs() as logs:
        try:
            daemon.start()
            assert daemon.wait_ready(HANG_S)
            (model,) = daemon.status({})["models"]
        finally:
            daemon.stop()

    assert asked == []
    assert (model["runtime"], model["fallback"]) == ("onnx_trt_ep", True)
    assert "disabled by runtime.enabled" in model["reason"]
    (line,) = [line for line in logs if line["event"] == "engine_rebuild_skipped"]
    assert line["cause"] == "RuntimeNotAvailableError"
    assert "disabled by runtime.enabled" in line["reason"]
    assert daemon.rebuilder is not None
    assert daemon.rebuilder._can_build() is False  # nor a build where TensorRT is left out


def test_every_cause_the_tensorrt_runtime_raises_is_sorted() -> None:
    """Each kind of error a ``tensorrt`` preparation raises is either one a build fixes
    or one it does not; a kind added later must be sorted here (``BUILD_FIXES``)."""
    from inferd.serving.slot import BUILD_FIXES, EXECUTION

    fixed = {type(exc).__name__ for exc in FIXED_BY_A_BUILD.values()}
    not_fixed = {type(exc).__name__ for exc in NOT_FIXED_BY_A_BUILD.values()}
    assert fixed | {EXECUTION, "EngineSchemaMismatchError", "EngineSidecarMissingError"} == set(
        BUILD_FIXES
    )
    assert not_fixed.isdisjoint(BUILD_FIXES)
    assert InferdError.__name__ not in BUILD_FIXES  # a strategy's bug, wrapped by prepare


# -- the causes the real runtime gives, sorted by what a build would do ----------------------


def _deployed(bench: Bench, model: Path) -> None:
    bench.deployed(bench.runtime(), model)


def _no_engine(bench: Bench, model: Path) -> dict[str, Any]:
    return {}


def _damaged_engine(bench: Bench, model: Path) -> dict[str, Any]:
    entry = bench.deployed(bench.runtime(), model)
    with entry.artifact_path.open("ab") as engine:
        engine.write(b"x")  # the gate refuses it; locate moves it aside
    return {}


def _failing_warm_up(bench: Bench, model: Path) -> dict[str, Any]:
    _deployed(bench, model)
    flag = bench.root / "executions-fail"
    flag.write_text("")
    bench.gpu.trt.execute_fail_while = str(flag)
    return {}


def _engine_dir_others_may_write(bench: Bench, model: Path) -> dict[str, Any]:
    _deployed(bench, model)
    os.chmod(bench.engine_dir, 0o777)  # a build's ensure_owned_dir refuses it too
    return {}


def _engine_dir_of_another_user(bench: Bench, model: Path) -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    _deployed(bench, model)
    os.chown(bench.engine_dir, 65534, 65534)
    return {}


def _tensorrt_disabled(bench: Bench, model: Path) -> dict[str, Any]:
    _deployed(bench, model)
    return {"enabled": ("onnx_trt_ep",)}


def _over_the_budget(bench: Bench, model: Path) -> dict[str, Any]:
    _deployed(bench, model)
    return {"gpu_memory_budget_bytes": 1}


def _no_such_device(bench: Bench, model: Path) -> dict[str, Any]:
    _deployed(bench, model)
    return {"device_id": 3}


def _unreadable_manifest(bench: Bench, model: Path) -> dict[str, Any]:
    _deployed(bench, model)
    manifest = bench.root / "deployment.json"
    manifest.write_text("{not json")
    return {"engine_manifest": manifest}


#: Each state the ``tensorrt`` runtime meets at activation, and whether a background
#: build (which needs the engine dir safely its own, as the runtime does) would leave
#: an engine that runtime then serves.
STATES: dict[str, tuple[Any, bool]] = {
    "no engine": (_no_engine, True),
    "engine damaged": (_damaged_engine, True),
    "warm-up fails": (_failing_warm_up, True),
    "engine dir others may write": (_engine_dir_others_may_write, False),
    "engine dir of another user": (_engine_dir_of_another_user, False),
    "tensorrt disabled": (_tensorrt_disabled, False),
    "over the gpu memory budget": (_over_the_budget, False),
    "no such cuda device": (_no_such_device, False),
    "deployment manifest unreadable": (_unreadable_manifest, False),
}


@pytest.mark.parametrize("state", sorted(STATES))
def test_the_cause_the_real_runtime_gives_is_sorted_by_what_a_build_would_do(
    bench: Bench, demo_model: Path, state: str
) -> None:
    """The check above sorts the test's own exception types; this one sorts what the
    ``tensorrt`` runtime (on the fakes) really raises through ``ModelSlot.activate``, so a
    state whose cause hides under a type a build fixes elsewhere fails here.  Before
    (review R1, F3): "engine dir others may write" gave ``EngineMissingError``, so a
    build was asked for and its start refused at once (``engine_build_failed``)."""
    make, a_build_fixes_it = STATES[state]
    overrides = make(bench, demo_model)
    slot = ModelSlot(ModelConfig(name="demo", path=demo_model, runtime="tensorrt"))
    sinks = Sinks(
        alert=lambda _alert: None,
        events=lambda _topic, _payload: None,
        record=bench.record,
        thermal=ThermalState.unavailable,
    )
    slot.activate(bench.config(**overrides), sinks)
    try:
        assert slot.state == "serving" and slot.is_fallback, slot.last_error
        assert (slot.fallback_cause in BUILD_FIXES) is a_build_fixes_it, (
            slot.fallback_cause,
            slot.last_error,
        )
    finally:
        slot.release()
