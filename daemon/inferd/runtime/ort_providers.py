"""Which ONNX Runtime execution providers a session was asked for, which it has,
and the one check that turns the difference into a degradation.

ONNX Runtime does not fail when it cannot create a provider.  Its C++ session
skips a provider whose library cannot be created (logging "Failed to create
TensorrtExecutionProvider ..."), and its Python ``InferenceSession`` retries a
session that failed at creation with ``['CUDAExecutionProvider',
'CPUExecutionProvider']`` (or CPU only), printing "EP Error ... Falling back to
... and retrying." before user code can intervene.  Only
``session.get_providers()`` says what was registered, and only
``session.get_provider_options()`` on which device: that retry passes no
options, so its CUDA EP runs on device 0 (``off_device``) and with an arena
without a cap (``uncapped``); ``ort_session`` makes such a session again with
the runtime's options.

The CUDA EP's arena (a BFC arena) grows to what the largest run needed and never
gives it back: without ``gpu_mem_limit`` (SIZE_MAX by default) one request with a
large dynamic dimension holds GPU memory, which a Jetson shares with the CPU, for
the session's life.  ``cuda_ep_options`` caps it (``runtime.ort_gpu_mem_limit_bytes``)
and grows it by what a run asks for (``kSameAsRequested``), not by doubling.  A
session that also registered the TensorRT EP takes its GPU memory from that EP's
arena instead (the first registered provider's, ``session_state.cc``), which no
option caps: its requests are bounded by the model's profiles, which that EP needs.

``ProviderResolution`` holds the three lists (what this runtime wants, what it
passed to ONNX Runtime, what the session registered); ``degradation`` names what
is missing, and ``refusal`` says whether the configuration forbids serving so.
The CPU-only case and the TensorRT-EP-missing case are the same comparison.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from inferd.config import RuntimeConfig

TRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
#: What ``onnx_trt_ep`` wants, best first: the TensorRT EP is the reason it exists.
PREFERRED_PROVIDERS: tuple[str, ...] = (TRT_EP, CUDA_EP, CPU_EP)
GPU_PROVIDERS: tuple[str, ...] = (TRT_EP, CUDA_EP)

#: The FDR record kind and alert code of every degradation.
DEGRADED_KIND = "provider_degraded"

#: Why a wanted provider is not registered.
MissingCause = Literal["not_in_build", "not_created"]
#: What the session lost: no GPU provider at all, or one of the two.
Degradation = Literal["cpu_only", "no_tensorrt_ep", "no_cuda_ep"]


def requested_providers(available: Sequence[str]) -> tuple[str, ...]:
    """The wanted providers this ONNX Runtime build offers (passing others only
    makes ONNX Runtime warn "Specified provider ... is not in available provider
    names" and skip them)."""
    offered = set(available)
    return tuple(name for name in PREFERRED_PROVIDERS if name in offered)


def off_device(registered: Mapping[str, Mapping[str, str]], device_id: int) -> dict[str, int]:
    """Each GPU provider in ``registered`` (``session.get_provider_options()``: the
    options each registered provider runs with) on another device than ``device_id``,
    with the device it is on.  A GPU provider given no ``device_id`` runs on device 0,
    as one made by the Python session's retry (which passes no options) does."""
    devices = {
        name: int(options.get("device_id", "0"))
        for name, options in registered.items()
        if name in GPU_PROVIDERS
    }
    return {name: device for name, device in devices.items() if device != device_id}


#: The CUDA EP's arena options as ``cuda_execution_provider_info.cc`` parses them
#: (strings, as every provider option): the bytes its arena may hold, and how it grows.
ARENA_OPTIONS: tuple[str, ...] = ("gpu_mem_limit", "arena_extend_strategy")
#: Extend by the request, not by a region that doubles each time (up to what is left
#: of the cap): the arena then holds what runs needed, not the next doubling.
SAME_AS_REQUESTED = "kSameAsRequested"


def cuda_arena_limit_bytes(config: RuntimeConfig) -> int:
    """The CUDA EP's arena cap: ``runtime.ort_gpu_mem_limit_bytes``, or for 0 the GPU
    memory budget (``runtime.gpu_memory_budget_bytes``)."""
    return config.ort_gpu_mem_limit_bytes or config.gpu_memory_budget_bytes


def cuda_ep_options(config: RuntimeConfig) -> dict[str, str]:
    """The CUDA EP's options: its device and its arena's cap.  A run past the cap fails
    with the arena's "Available memory of X is smaller than requested bytes of Y"
    (``ort_errors``: ``RESOURCE_EXHAUSTED``) and the session serves on."""
    return {
        "device_id": str(config.device_id),
        "gpu_mem_limit": str(cuda_arena_limit_bytes(config)),
        "arena_extend_strategy": SAME_AS_REQUESTED,
    }


def uncapped(
    registered: Mapping[str, Mapping[str, str]], asked: Mapping[str, Mapping[str, str]]
) -> dict[str, str]:
    """Each provider in ``registered`` (``session.get_provider_options()``) whose arena
    options are not the ones ``asked`` for it, with the ``gpu_mem_limit`` it runs with
    (the Python session's retry passes no options: SIZE_MAX, no cap)."""
    return {
        name: options.get("gpu_mem_limit", "(none)")
        for name, options in registered.items()
        if any(
            key in asked.get(name, {}) and options.get(key) != asked[name][key]
            for key in ARENA_OPTIONS
        )
    }


@dataclass(frozen=True)
class ProviderResolution:
    requested: tuple[str, ...]
    active: tuple[str, ...]
    wanted: tuple[str, ...] = PREFERRED_PROVIDERS

    @property
    def missing(self) -> dict[str, MissingCause]:
        """Each wanted GPU provider the session did not register, and why."""
        return {
            name: "not_created" if name in self.requested else "not_in_build"
            for name in self.wanted
            if name in GPU_PROVIDERS and name not in self.active
        }

    @property
    def degradation(self) -> Degradation | None:
        missing = self.missing
        if not missing:
            return None
        if all(name in missing for name in GPU_PROVIDERS):
            return "cpu_only"
        return "no_tensorrt_ep" if TRT_EP in missing else "no_cuda_ep"

    @property
    def dropped_silently(self) -> tuple[str, ...]:
        """Providers ONNX Runtime was asked for and did not register (skipped or
        retried away): the surprise an operator must hear about."""
        return tuple(name for name, cause in self.missing.items() if cause == "not_created")

    def refusal(self, config: RuntimeConfig) -> str | None:
        """Why ``config`` forbids serving on this session, or None."""
        missing = self.missing
        if config.ort_require_tensorrt_ep and TRT_EP in missing:
            return (
                f"the session has no {TRT_EP} ({_cause_text(missing[TRT_EP])}; requested "
                f"{list(self.requested)}, registered {list(self.active)}) and "
                "runtime.ort_require_tensorrt_ep is set"
            )
        if config.ort_disallow_cpu_fallback and self.degradation == "cpu_only":
            return (
                f"the session resolved to {CPU_EP} only (requested {list(self.requested)}, "
                f"registered {list(self.active)}) and runtime.ort_disallow_cpu_fallback is set"
            )
        return None

    def describe(self) -> str:
        """One sentence for logs and alerts: what is missing and why."""
        parts = [f"{name} {_cause_text(cause)}" for name, cause in self.missing.items()]
        serving = "GPU (CUDA)" if CUDA_EP in self.active else "CPU"
        if TRT_EP in self.active:
            serving = "TensorRT EP without CUDA EP (nodes TensorRT cannot run go to CPU)"
        return f"{'; '.join(parts)}; serving on {serving}"


def _cause_text(cause: MissingCause) -> str:
    if cause == "not_in_build":
        return "is not in this ONNX Runtime build" + (
            " (both the onnxruntime and the onnxruntime-gpu wheels are installed: they "
            "share one `onnxruntime` package, so the CPU wheel can hide the GPU one; "
            "uninstall both and install one: the `gpu` extra or NVIDIA's JetPack wheel)"
            if both_ort_wheels_installed()
            else ""
        )
    return "was requested but ONNX Runtime did not create it"


@functools.cache
def both_ort_wheels_installed() -> bool:
    """Whether the CPU and a GPU ONNX Runtime distribution are both installed: the
    explicit choice of one (the `cpu` or `gpu` extra) was not made."""
    names = {"onnxruntime", "onnxruntime-gpu"}
    found = set()
    for distribution in importlib.metadata.distributions():
        name = (distribution.metadata["Name"] or "").lower().replace("_", "-")
        if name in names:
            found.add(name)
    return found == names


def degradation_payload(
    resolution: ProviderResolution, *, refused: bool, staged_engine: str | None
) -> Mapping[str, object]:
    """The ``provider_degraded`` payload (the slot adds ``model``)."""
    return {
        "degradation": resolution.degradation,
        "requested": list(resolution.requested),
        "active": list(resolution.active),
        "missing": dict(resolution.missing),
        "refused": refused,
        "staged_engine_unused": staged_engine,
    }
