"""The runtime factory: flag checks come before imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inferd.config import RuntimeConfig
from inferd.errors import RuntimeNotAvailableError
from inferd.runtime import build_inference_runtime


def run_isolated(code: str) -> str:
    """Run ``code`` in a fresh interpreter so sys.modules starts clean."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_inferd_loads_no_heavy_dependency() -> None:
    output = run_isolated("""
        import sys
        import inferd, inferd.config, inferd.runtime, inferd.daemon, inferd.cli
        heavy = ["onnxruntime", "tensorrt", "pycuda", "jtop", "pynvml", "systemd",
                 "inferd.runtime.onnx_trt_ep", "inferd.runtime.tensorrt"]
        print(sorted(name for name in heavy if name in sys.modules))
    """)
    assert output == "[]"


def test_disabled_strategy_is_never_imported(tmp_path: Path) -> None:
    output = run_isolated(f"""
        import sys
        from pathlib import Path
        from inferd.config import RuntimeConfig
        from inferd.errors import RuntimeNotAvailableError
        from inferd.runtime import build_inference_runtime
        config = RuntimeConfig(enabled=("tensorrt",), ort_trt_cache_dir=Path({str(tmp_path)!r}))
        try:
            build_inference_runtime("onnx_trt_ep", config)
        except RuntimeNotAvailableError as exc:
            print("refused:", exc.reason)
        print("onnx_trt_ep" , "inferd.runtime.onnx_trt_ep" in sys.modules,
              "onnxruntime" in sys.modules)
    """)
    assert output.splitlines() == [
        "refused: disabled by runtime.enabled",
        "onnx_trt_ep False False",
    ]


def test_enabled_strategy_is_imported_only_when_built(tmp_path: Path) -> None:
    output = run_isolated(f"""
        import sys
        from pathlib import Path
        from inferd.config import RuntimeConfig
        from inferd.runtime import build_inference_runtime
        config = RuntimeConfig(ort_trt_cache_dir=Path({str(tmp_path)!r}))
        print("before", "inferd.runtime.onnx_trt_ep" in sys.modules)
        runtime = build_inference_runtime("onnx_trt_ep", config)
        print("after", "inferd.runtime.onnx_trt_ep" in sys.modules, runtime.current_runtime_label())
    """)
    assert output.splitlines() == ["before False", "after True onnx_trt_ep"]


def test_unknown_label_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeNotAvailableError, match="unknown runtime label"):
        build_inference_runtime("cuda", RuntimeConfig(ort_trt_cache_dir=tmp_path))


def test_tensorrt_without_the_library_is_not_available(tmp_path: Path) -> None:
    """On a machine without TensorRT the strategy refuses at composition time,
    which is what makes the service fail over."""
    with pytest.raises(RuntimeNotAvailableError) as caught:
        build_inference_runtime("tensorrt", RuntimeConfig(ort_trt_cache_dir=tmp_path))
    assert caught.value.label == "tensorrt"
    assert "tensorrt" in caught.value.reason


def test_onnx_trt_ep_without_an_importable_onnxruntime_is_not_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broken onnxruntime (a bad wheel, a numpy ABI mismatch) refuses at composition
    time like a missing TensorRT: never an ImportError escaping the strategy."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # importing it raises ImportError
    with pytest.raises(RuntimeNotAvailableError) as caught:
        build_inference_runtime("onnx_trt_ep", RuntimeConfig(ort_trt_cache_dir=tmp_path))
    assert caught.value.label == "onnx_trt_ep"
    assert "cannot import onnxruntime" in caught.value.reason
