"""``run_build`` with the real builder code (``TensorRTBuilder``) on the fake TensorRT:
the same adapter, token, timing-cache policy and artifacts as the simulated runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from inferd.build import BuildRequest, CancellationToken, run_build
from inferd.build.tensorrt_builder import TensorRTBuilder
from inferd.build.validation import reference_outputs
from inferd.types import BuildConfig, HostTuple, PrecisionMode
from tests.fakes import fake_tensorrt

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "schemas" / "build" / "summary.json").read_text())
HOST = HostTuple((8, 7), "orin", "r36.4.0", "10.3.0.30", PrecisionMode.FP32)


@pytest.fixture
def stack(monkeypatch: pytest.MonkeyPatch) -> fake_tensorrt.FakeGpuStack:
    return fake_tensorrt.install(monkeypatch)


def builder(stack: fake_tensorrt.FakeGpuStack, model: Path, **kw: Any) -> TensorRTBuilder:
    return TensorRTBuilder(stack.tensorrt, stack.driver, model, BuildConfig(), **kw)


def request(tmp_path: Path, model: Path) -> BuildRequest:
    return BuildRequest(model, tmp_path / "demo.engine", BuildConfig(), HOST)


def test_real_builder_code_completes_with_cold_then_reused_cache(
    tmp_path: Path, demo_model: Path, stack: fake_tensorrt.FakeGpuStack
) -> None:
    first = run_build(request(tmp_path, demo_model), builder(stack, demo_model))
    s = first.summary
    Draft202012Validator(SCHEMA).validate(s)
    assert s["outcome"] == "completed" and s["simulated"] is False
    assert s["tensorrtVersion"] == fake_tensorrt.TRT10_VERSION
    assert s["timingCacheMode"] == "cold" and s["timingCache"]["saved"]
    assert s["validationStatus"] == "pending" and not s["eligibleToServe"]
    assert (tmp_path / "demo.engine").read_bytes().startswith(fake_tensorrt.ENGINE_MAGIC)
    assert s["phaseTree"]["roots"][0]["name"] == "Building engine"
    assert stack.trt.last_build["progress_monitor"] is True
    second = run_build(request(tmp_path, demo_model), builder(stack, demo_model))
    assert second.summary["timingCacheMode"] == "reused"
    assert stack.trt.timing_cache_hits == 1


def test_real_builder_code_validates_with_an_infer_callable(
    tmp_path: Path, demo_model: Path, stack: fake_tensorrt.FakeGpuStack
) -> None:
    # Smoke inference belongs to the serving runtime; here a stand-in returning ORT's outputs.
    report = run_build(
        request(tmp_path, demo_model),
        builder(stack, demo_model, infer=lambda _e, inputs: reference_outputs(demo_model, inputs)),
    )
    assert report.summary["validationStatus"] == "pass" and report.summary["eligibleToServe"]


def test_refused_cache_is_quarantined_and_the_build_goes_cold(
    tmp_path: Path, demo_model: Path, stack: fake_tensorrt.FakeGpuStack
) -> None:
    run_build(request(tmp_path, demo_model), builder(stack, demo_model))
    cache = next(tmp_path.glob("timing_*.cache"))
    cache.write_bytes(b"timing cache of another TensorRT version")
    report = run_build(request(tmp_path, demo_model), builder(stack, demo_model))
    s = report.summary
    assert s["timingCacheMode"] == "quarantined" and s["outcome"] == "completed"
    assert Path(s["timingCache"]["quarantinedTo"] + ".reason").is_file()


def test_cancel_through_step_complete(
    tmp_path: Path, demo_model: Path, stack: fake_tensorrt.FakeGpuStack
) -> None:
    token = CancellationToken()

    def listener(event: Any) -> None:
        if event.type == "step" and event.name == "Timing graph nodes":
            token.cancel("control")

    report = run_build(
        request(tmp_path, demo_model), builder(stack, demo_model), token=token, listener=listener
    )
    s = report.summary
    assert s["outcome"] == "cancelled" and s["cancelSource"] == "control"
    assert "cancelled" in (s["error"] or "").lower()
    assert s["cleanupStatus"] == "cleaned" and not (tmp_path / "demo.engine").exists()
    assert s["timingCacheMode"] == "discarded" and not list(tmp_path.glob("timing_*.cache"))
    assert s["cancelLatencyMs"] is not None and s["cleanupLatencyMs"] is not None
    assert s["phaseTree"]["roots"][0]["status"] == "finished_early"


def test_parser_failure_is_a_failed_build(
    tmp_path: Path, stack: fake_tensorrt.FakeGpuStack
) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    report = run_build(request(tmp_path, bad), builder(stack, bad))
    assert report.summary["outcome"] == "failed"
    assert report.summary["retryPolicy"] == "investigate"


def test_acceptance_uses_the_real_builder_when_tensorrt_is_present(
    tmp_path: Path, stack: fake_tensorrt.FakeGpuStack
) -> None:
    from inferd.build import acceptance

    pair = (stack.tensorrt, stack.driver)
    names = list(acceptance.TENSORRT_SCENARIOS)
    assert acceptance.run(tmp_path, scenarios=names, tensorrt=pair) == 0, (
        tmp_path / "report.md"
    ).read_text()
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["label"] == "simulated+tensorrt"
    assert evidence["tensorrt"] == fake_tensorrt.TRT10_VERSION
    assert {s["builder"] for s in evidence["scenarios"]} == {"tensorrt"}
    assert not any(s["simulated"] for s in evidence["scenarios"])
    [row] = evidence["cancelLatencies"]
    assert row["builder"] == "tensorrt" and row["source"] == "control"


def test_acceptance_without_tensorrt_is_simulated_only(tmp_path: Path) -> None:
    from inferd.build import acceptance

    assert acceptance.run(tmp_path, scenarios=["ide_stop"], tensorrt=False) == 0
    evidence = json.loads((tmp_path / "evidence.json").read_text())
    assert evidence["label"] == "simulated" and evidence["tensorrt"] is None
