"""Fake audit: a GPU provider's ``device_id`` as ONNX Runtime checks it when it creates
the provider: the CUDA EP's option parser ("Invalid device ID: <n>, must be between 0
(inclusive) and <count> (exclusive).", ``cuda_execution_provider_info.cc``) and the
TensorRT EP's constructor (``CUDA_CALL_THROW(cudaSetDevice(device_id_))``) throw, and
the Python session's fallback retries with ``['CUDAExecutionProvider',
'CPUExecutionProvider']`` *without* the options, that is on device 0.  The fake used
to accept any ``device_id``.  What the runtime makes of it (a session made again on
the configured device, never served on device 0): ``test_ort_device_fallback.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.runtime.onnx_trt_ep import CPU_EP, CUDA_EP, TRT_EP
from tests.fakes import fake_onnxruntime
from tests.fakes.fake_onnxruntime import FakeOrt


def test_a_device_id_the_host_lacks_fails_the_gpu_providers(
    monkeypatch: pytest.MonkeyPatch, demo_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_onnxruntime.install(monkeypatch, FakeOrt(device_count=1))
    import onnxruntime as ort

    options = [{"device_id": "1"}, {"device_id": "1"}, {}]
    cuda_only = ort.InferenceSession(
        str(demo_model), providers=[CUDA_EP, CPU_EP], provider_options=options[1:]
    )
    assert cuda_only.get_providers() == [CPU_EP]  # silently on the CPU
    session = ort.InferenceSession(
        str(demo_model), providers=[TRT_EP, CUDA_EP, CPU_EP], provider_options=options
    )
    assert session.get_providers() == [CUDA_EP, CPU_EP]  # the fallback: no options,
    assert session.get_provider_options()[CUDA_EP]["device_id"] == "0"  # so device 0
    out = capsys.readouterr().out
    assert "Invalid device ID: 1, must be between 0 (inclusive) and 1 (exclusive)." in out
    assert "invalid device ordinal" in out
