"""Read this host's ``HostTuple``: GPU, platform release and TensorRT version.

* GPU: NVML first (``inferd.nvml.handle_for_cuda_device``: the GPU CUDA numbers
  ``device_index``, by PCI bus id when NVML sees several; ``nvmlDeviceGetName``,
  ``nvmlDeviceGetCudaComputeCapability``), then the CUDA driver through pycuda
  (``pycuda.driver.init()``, ``Device(i).name()``, ``.compute_capability()``;
  no context is created).  Jetson's integrated GPU usually has no NVML, so it is
  read through pycuda there.  The probe order is fixed, so one host always
  names its GPU the same way; the name is sanitized by ``sanitize_sku``.
* Platform: the L4T release in ``/etc/nv_tegra_release``
  (``# R36 (release), REVISION: 4.0, GCID: ...`` -> ``r36.4.0``); ``none`` when
  the file does not exist (not a Jetson).  A file that exists but cannot be read
  or parsed is an error, never ``none``: a Jetson must not pass for a desktop.
* TensorRT: ``tensorrt.__version__``, verbatim.

Each probe is injectable.  ``pynvml`` (in ``inferd.nvml``), ``pycuda`` and
``tensorrt`` are imported inside the probes only.  Anything missing raises
``HostTupleUnavailableError`` naming every part that failed and why; the
service turns that into failover.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from inferd.engines.naming import sanitize_sku
from inferd.errors import HostTupleUnavailableError
from inferd.nvml import NvmlUnavailableError, handle_for_cuda_device
from inferd.types import HostTuple, PrecisionMode

NV_TEGRA_RELEASE = Path("/etc/nv_tegra_release")
PLATFORM_NONE = "none"
#: A release file is a few hundred bytes; never read more than this.
_RELEASE_MAX_BYTES = 64 * 1024

_RELEASE_LINE = re.compile(
    r"^#\s*R(\d+)\s*\(release\)\s*,\s*REVISION:\s*(\d+(?:\.\d+)*)", re.IGNORECASE | re.MULTILINE
)

log = structlog.get_logger("inferd.engines")


@dataclass(frozen=True)
class GpuInfo:
    """What a GPU probe reports: the raw device name and compute capability."""

    name: str
    compute_capability: tuple[int, int]
    source: str


#: ``probe(device_index) -> GpuInfo``; raises (anything) when it cannot tell.
GpuProbe = Callable[[int], GpuInfo]


def _name_text(raw: Any) -> str:
    # nvidia-ml-py >= 11.515 returns str (convertStrBytes); older bindings bytes.
    if isinstance(raw, bytes):
        return raw.decode("utf-8", "replace")
    return str(raw)


def _capability(raw: Any) -> tuple[int, int]:
    major, minor = raw
    return int(major), int(minor)


def probe_gpu_nvml(device_index: int = 0) -> GpuInfo:
    """GPU name and compute capability through NVML, of the GPU CUDA numbers
    ``device_index`` (``inferd.nvml.handle_for_cuda_device``): NVML's numbering is not
    CUDA's, so with several GPUs the device is found by its PCI bus id, and where it
    cannot be told this probe fails and the next one (CUDA's own view) answers."""
    try:
        device = handle_for_cuda_device(device_index)
    except NvmlUnavailableError as exc:
        raise HostTupleUnavailableError(str(exc)) from exc
    with device:  # gives back this probe's nvmlInit; other NVML users are unaffected
        try:
            name = _name_text(device.nvml.nvmlDeviceGetName(device.handle))
            capability = _capability(device.nvml.nvmlDeviceGetCudaComputeCapability(device.handle))
        except Exception as exc:
            raise HostTupleUnavailableError(
                f"nvml: device {device_index} ({device.matched_by}): {exc}"
            ) from exc
    return GpuInfo(name=name, compute_capability=capability, source="nvml")


def probe_gpu_pycuda(device_index: int = 0) -> GpuInfo:
    """GPU name and compute capability through the CUDA driver API (pycuda).

    Only ``cuInit`` and device queries: no CUDA context is created here, so the
    engine worker's ownership of the context is untouched."""
    try:
        import pycuda.driver as cuda
    except Exception as exc:
        raise HostTupleUnavailableError(f"pycuda: pycuda.driver is not importable ({exc})") from exc
    try:
        cuda.init()
        device = cuda.Device(device_index)
        name = _name_text(device.name())
        capability = _capability(device.compute_capability())
    except Exception as exc:  # pycuda._driver.Error subclasses
        raise HostTupleUnavailableError(f"pycuda: device {device_index}: {exc}") from exc
    return GpuInfo(name=name, compute_capability=capability, source="pycuda")


DEFAULT_GPU_PROBES: tuple[GpuProbe, ...] = (probe_gpu_nvml, probe_gpu_pycuda)


def parse_nv_tegra_release(text: str) -> str:
    """``# R36 (release), REVISION: 4.0, GCID: ...`` -> ``r36.4.0``; ValueError otherwise."""
    match = _RELEASE_LINE.search(text)
    if match is None:
        first = text.strip().splitlines()[0][:120] if text.strip() else "(empty)"
        raise ValueError(
            f"no '# R<release> (release), REVISION: <x.y>' line (first line: {first!r})"
        )
    release = str(int(match.group(1)))
    revision = ".".join(str(int(part)) for part in match.group(2).split("."))
    return f"r{release}.{revision}"


def read_platform_release(path: Path = NV_TEGRA_RELEASE) -> str:
    """The L4T release (``r36.4.0``) or ``none`` when ``path`` does not exist."""
    try:
        with path.open("rb") as handle:
            data = handle.read(_RELEASE_MAX_BYTES)
    except FileNotFoundError:
        return PLATFORM_NONE
    except OSError as exc:
        raise HostTupleUnavailableError(f"cannot read {path}: {exc}") from exc
    try:
        return parse_nv_tegra_release(data.decode("utf-8", "replace"))
    except ValueError as exc:
        raise HostTupleUnavailableError(f"{path} is not parseable: {exc}") from exc


def probe_tensorrt_version() -> str:
    """``tensorrt.__version__`` (imports TensorRT)."""
    try:
        import tensorrt
    except Exception as exc:
        raise HostTupleUnavailableError(
            f"tensorrt: the tensorrt package is not importable ({exc})"
        ) from exc
    version = getattr(tensorrt, "__version__", None)
    if not isinstance(version, str) or not version:
        raise HostTupleUnavailableError(
            f"tensorrt: tensorrt.__version__ is missing or not a string ({version!r})"
        )
    return version


def _message(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def read_host_tuple(
    *,
    precision: PrecisionMode,
    device_index: int = 0,
    gpu_probes: Sequence[GpuProbe] | None = None,
    tegra_release: Path = NV_TEGRA_RELEASE,
    tensorrt_version: Callable[[], str] | None = None,
) -> HostTuple:
    """This host's tuple for ``precision`` on GPU ``device_index``.

    ``gpu_probes`` are tried in order until one answers (default: NVML, then
    pycuda).  Raises ``HostTupleUnavailableError`` whose ``causes`` names each
    part (``gpu``, ``platform``, ``tensorrt``) that could not be read.
    """
    causes: dict[str, str] = {}

    gpu: GpuInfo | None = None
    gpu_failures: list[str] = []
    for probe in DEFAULT_GPU_PROBES if gpu_probes is None else gpu_probes:
        try:
            gpu = probe(device_index)
            break
        except Exception as exc:
            gpu_failures.append(_message(exc))
    if gpu is None:
        causes["gpu"] = "; ".join(gpu_failures) or "no GPU probe configured"

    platform: str | None = None
    try:
        platform = read_platform_release(tegra_release)
    except HostTupleUnavailableError as exc:
        causes["platform"] = _message(exc)

    version: str | None = None
    try:
        version = (tensorrt_version or probe_tensorrt_version)()
    except Exception as exc:
        causes["tensorrt"] = _message(exc)

    if gpu is None or platform is None or version is None:
        raise HostTupleUnavailableError(
            "cannot read this host's engine tuple: "
            + "; ".join(f"{part}: {why}" for part, why in causes.items()),
            causes=causes,
        )
    try:
        host = HostTuple(
            compute_capability=gpu.compute_capability,
            gpu_sku=sanitize_sku(gpu.name),
            platform=platform,
            tensorrt_version=version,
            precision=precision,
        )
    except ValueError as exc:
        raise HostTupleUnavailableError(
            f"cannot read this host's engine tuple: {exc}", causes={"tuple": str(exc)}
        ) from exc
    log.debug("host_tuple", gpu_source=gpu.source, gpu_name=gpu.name, **host.describe())
    return host
