from __future__ import annotations

import numpy as np
import onnxruntime as ort

from inferd_client import InferenceClient
from tests.conftest import DaemonProcess


def test_demo_outputs_equal_in_process_ort(daemon: DaemonProcess, demo_model) -> None:
    image = np.random.default_rng(7).random((1, 3, 224, 224), dtype=np.float32)
    session = ort.InferenceSession(str(demo_model), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"image": image})[0]
    with InferenceClient(daemon.infer) as client:
        outputs = client.infer("demo", {"image": image})
        assert client.last_reply["runtime"] == "onnx_trt_ep"
        assert client.last_reply["fallback"] is False
    np.testing.assert_array_equal(outputs["descriptors"], expected)
