"""What the checks of one self-test run share: the work directory, the demo
model, the device, the prerequisites (each raising ``Skipped`` with the precise
reason it is missing) and the engine the build check made for later checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferd.config import RuntimeConfig
from inferd.engines.host import read_host_tuple
from inferd.errors import HostTupleUnavailableError
from inferd.selftest.check import Skipped
from inferd.types import HostTuple, PrecisionMode

#: The host tuple's parts a machine without a GPU stack lacks (a skip, not a fault);
#: any other cause (an unparseable /etc/nv_tegra_release) is a fault.
MISSING_GPU_STACK = frozenset({"gpu", "tensorrt"})


def _reason(what: str, exc: BaseException) -> str:
    return f"{what}: {type(exc).__name__}: {exc}"


@dataclass
class SelftestContext:
    work_dir: Path
    device_id: int = 0
    #: A model to use instead of writing the bundled demo model (a test seam).
    demo_model_path: Path | None = None
    #: The engine ``tensorrt.build`` built, validated and recorded in the manifest
    #: of ``engine_dir``; ``None`` until that check passed.
    trusted_engine: Path | None = None
    _host: HostTuple | None = field(default=None, init=False, repr=False)
    _host_error: HostTupleUnavailableError | None = field(default=None, init=False, repr=False)

    # -- the work directory -------------------------------------------------------------

    def directory(self, name: str) -> Path:
        """A fresh subdirectory of the work directory for one check."""
        path = self.work_dir / name
        path.mkdir(parents=True, exist_ok=False)
        return path

    @property
    def engine_dir(self) -> Path:
        """Where ``tensorrt.build`` writes the engine and its manifest, and where the
        TensorRT daemon check looks for it."""
        return self.work_dir / "engines"

    @property
    def runtime_config(self) -> RuntimeConfig:
        """The daemon's default runtime settings on this run's device and engine dir
        (GPU memory budget, hence the build workspace rule)."""
        return RuntimeConfig(device_id=self.device_id, engine_dir=self.engine_dir)

    def demo_model(self) -> Path:
        if self.demo_model_path is None:
            from inferd.demo_model import write_demo_model

            self.demo_model_path = write_demo_model(self.work_dir / "models" / "demo.onnx")
        return self.demo_model_path

    # -- prerequisites ------------------------------------------------------------------

    def tensorrt(self) -> Any:
        try:
            import tensorrt
        except Exception as exc:  # ImportError, or OSError from a broken libnvinfer
            raise Skipped(_reason("tensorrt not importable", exc)) from exc
        return tensorrt

    def cuda(self) -> Any:
        try:
            import pycuda.driver as cuda
        except Exception as exc:
            raise Skipped(_reason("pycuda.driver not importable", exc)) from exc
        return cuda

    def host_tuple(self) -> HostTuple:
        """This host's tuple (fp32), read once; ``HostTupleUnavailableError`` otherwise."""
        if self._host is None and self._host_error is None:
            try:
                self._host = read_host_tuple(
                    precision=PrecisionMode.FP32, device_index=self.device_id
                )
            except HostTupleUnavailableError as exc:
                self._host_error = exc
        if self._host_error is not None:
            raise self._host_error
        assert self._host is not None
        return self._host

    def gpu_stack(self) -> tuple[Any, Any, HostTuple]:
        """TensorRT, pycuda's driver and this host's tuple, or ``Skipped`` naming the
        first one missing."""
        trt = self.tensorrt()
        cuda = self.cuda()
        try:
            host = self.host_tuple()
        except HostTupleUnavailableError as exc:
            raise Skipped(f"host tuple unavailable: {exc}") from exc
        return trt, cuda, host

    def built_engine(self) -> Path:
        self.gpu_stack()  # the same reason as tensorrt.build when the GPU stack is missing
        if self.trusted_engine is None:
            raise Skipped("needs the engine of check tensorrt.build, which did not pass")
        return self.trusted_engine
