"""The CUDA EP's arena has a cap (``runtime.ort_gpu_mem_limit_bytes``; 0: the GPU memory
budget): ONNX Runtime's BFC arena grows to what the largest run needed and never gives
it back, and without ``gpu_mem_limit`` (SIZE_MAX) one request with a large dynamic
dimension held that memory for the session's life.  Against the fake ONNX Runtime of
``tests/fakes/fake_onnxruntime.py`` (the arena of 1.18-1.20, its texts): the options
reach the CUDA EP, a run past the cap is ``RESOURCE_EXHAUSTED`` and the model serves
on, and the Python session's retry, which drops every option, is made again capped."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferd.config import ModelConfig
from inferd.errors import EngineDeserializeError
from inferd.runtime.onnx_trt_ep import CPU_EP, CUDA_EP, TRT_EP
from inferd.runtime.ort_providers import uncapped
from inferd.serving.engine_worker import EngineWorker
from inferd.serving.scheduler import Job, Scheduler
from inferd.serving.slot import ModelSlot
from inferd_wire import protocol
from tests.fakes import fake_onnxruntime
from tests.fakes.fake_onnxruntime import SIZE_MAX, FakeOrt
from tests.unit.runtime.test_ort_providers import LOAD_LIBRARY_FAILED, Sinks, load, make_runtime
from tests.unit.serving.reply_queue import ReplyQueue

MIB = 1024 * 1024
#: One row of the identity model's input (and of its output): f32[3, 224, 224].
ROW_BYTES = 3 * 224 * 224 * 4


def cuda_options(ort: FakeOrt) -> dict[str, str]:
    """The CUDA EP's options in the last session made, as it registered them."""
    options: dict[str, str] = ort.sessions[-1]["options"][CUDA_EP]
    return options


@pytest.mark.parametrize(
    ("overrides", "limit"),
    [
        ({"ort_gpu_mem_limit_bytes": 64 * MIB}, 64 * MIB),
        ({"gpu_memory_budget_bytes": 2 * 1024 * MIB}, 2 * 1024 * MIB),  # 0: the budget
    ],
)
def test_the_cuda_ep_runs_with_the_configured_arena_cap(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    demo_model: Path,
    overrides: dict[str, int],
    limit: int,
) -> None:
    ort = fake_onnxruntime.install(monkeypatch)
    handle = load(make_runtime(tmp_path, Sinks(), **overrides), demo_model)
    assert handle.active_providers == (TRT_EP, CUDA_EP, CPU_EP)
    assert len(ort.sessions) == 1
    options = cuda_options(ort)
    assert options["gpu_mem_limit"] == str(limit)  # was SIZE_MAX: no cap
    assert options["arena_extend_strategy"] == "kSameAsRequested"
    assert options["device_id"] == "0"


def rows(count: int) -> dict[str, np.ndarray]:
    return {"input": np.ones((count, 3, 224, 224), np.float32)}


def test_a_run_past_the_cap_is_resource_exhausted_and_the_model_serves_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, identity_model: Path
) -> None:
    """An ONNX Runtime without the TensorRT EP (a dynamic input needs no profile then:
    only the message limits bound its size): the session's GPU arena is the CUDA EP's.
    A request whose tensors would take the arena past its cap is answered
    ``RESOURCE_EXHAUSTED`` by the engine worker with the arena's words, the arena keeps
    what it held, and the next request within the cap is served."""
    ort = fake_onnxruntime.install(monkeypatch, FakeOrt(available=(CUDA_EP, CPU_EP)))
    cap = 8 * MIB
    runtime = make_runtime(tmp_path, Sinks(), ort_gpu_mem_limit_bytes=cap)
    handle = load(runtime, identity_model)
    assert handle.active_providers == (CUDA_EP, CPU_EP)
    arena = ort.sessions[-1]["arena"]
    slot = ModelSlot(ModelConfig(name="ident", path=identity_model))
    slot.runtime, slot.handle, slot.state = runtime, handle, "serving"
    scheduler = Scheduler()
    scheduler.add_model("ident", 8, "fifo")
    worker = EngineWorker(ReplyQueue(), scheduler, {"ident": slot}, activate=lambda _slot: None)

    def reply(count: int) -> dict[str, Any]:
        job = Job([b"client", b""], 1, "ident", rows(count), time.monotonic_ns(), None)
        return protocol.unpack_header(worker._run(job)[2])

    assert reply(4)["ok"]  # 2 x 2.4 MB
    held = arena.held
    refused = reply(8)  # 2 x 4.8 MB: past 8 MiB
    assert refused["error"]["code"] == "RESOURCE_EXHAUSTED"
    assert "ran out of memory" in refused["error"]["message"]  # the arena's text is logged (207)
    assert arena.held == held <= cap
    assert reply(5)["ok"]  # the session serves on (2 x 3 MB: within what its arena holds)
    assert arena.held == held


def test_onnx_runtimes_retry_is_made_again_with_the_cap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model: Path
) -> None:
    """The TensorRT EP fails at creation on device 0 (a Jetson): ONNX Runtime's retry
    on [CUDA EP, CPU] passes no options, so its CUDA EP had no cap
    (``gpu_mem_limit`` SIZE_MAX, doubling).  It is made again with the runtime's."""
    ort = fake_onnxruntime.install(monkeypatch, FakeOrt(trt_creation_error=LOAD_LIBRARY_FAILED))
    handle = load(make_runtime(tmp_path, Sinks(), ort_gpu_mem_limit_bytes=64 * MIB), demo_model)
    assert handle.active_providers == (CUDA_EP, CPU_EP)
    retried, served = ort.sessions
    assert retried["options"][CUDA_EP]["gpu_mem_limit"] == str(SIZE_MAX)
    assert served["requested"] == [CUDA_EP, CPU_EP]
    assert cuda_options(ort)["gpu_mem_limit"] == str(64 * MIB)
    assert served["arena"].limit == 64 * MIB


def test_a_session_still_without_the_cap_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_model: Path
) -> None:
    """An ONNX Runtime whose CUDA EP ignores ``gpu_mem_limit``: made again once, then
    refused naming the key (the slot fails over or fails)."""
    ort = fake_onnxruntime.install(monkeypatch)
    import onnxruntime

    real = onnxruntime.InferenceSession.get_provider_options

    def ignores_the_cap(session: Any) -> dict[str, dict[str, str]]:
        options = real(session)
        return {**options, CUDA_EP: {**options[CUDA_EP], "gpu_mem_limit": str(SIZE_MAX)}}

    monkeypatch.setattr(onnxruntime.InferenceSession, "get_provider_options", ignores_the_cap)
    with pytest.raises(EngineDeserializeError) as refused:
        load(make_runtime(tmp_path, Sinks(), ort_gpu_mem_limit_bytes=64 * MIB), demo_model)
    message = str(refused.value)
    assert f"{CUDA_EP} with gpu_mem_limit {SIZE_MAX} (asked {64 * MIB})" in message
    assert "runtime.ort_gpu_mem_limit_bytes" in message
    assert len(ort.sessions) == 2


def test_uncapped_names_each_provider_without_the_arena_options_asked() -> None:
    asked = {CUDA_EP: {"gpu_mem_limit": "1024", "arena_extend_strategy": "kSameAsRequested"}}
    capped = {**asked, CPU_EP: {}}
    assert uncapped(capped, asked) == {}
    retry = {CUDA_EP: {"device_id": "0", "gpu_mem_limit": str(SIZE_MAX)}, CPU_EP: {}}
    assert uncapped(retry, asked) == {CUDA_EP: str(SIZE_MAX)}
    doubling = {CUDA_EP: {**asked[CUDA_EP], "arena_extend_strategy": "kNextPowerOfTwo"}}
    assert uncapped(doubling, asked) == {CUDA_EP: "1024"}
    assert uncapped({TRT_EP: {"device_id": "0"}, CPU_EP: {}}, asked) == {}  # not registered


def test_a_cuda_ep_option_onnx_runtime_does_not_know_fails_the_provider(
    monkeypatch: pytest.MonkeyPatch, demo_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fake audit: the CUDA EP's option parser refuses an unknown key and an unknown
    strategy (``ProviderOptionsParser``), as the real one does, so the runtime's keys
    are checked; the Python session's retry then makes a CUDA EP without the options."""
    fake_onnxruntime.install(monkeypatch)
    import onnxruntime as ort

    for bad, said in (
        ({"gpu_mem_limt": "1024"}, 'Unknown provider option: "gpu_mem_limt".'),
        ({"arena_extend_strategy": "1"}, 'Failed to parse provider option "arena_extend'),
    ):
        session = ort.InferenceSession(
            str(demo_model), providers=[TRT_EP, CUDA_EP, CPU_EP], provider_options=[{}, bad, {}]
        )
        assert session.get_provider_options()[CUDA_EP]["gpu_mem_limit"] == str(SIZE_MAX)
        assert said in capsys.readouterr().out
