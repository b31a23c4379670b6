"""An ONNX Runtime session made on the GPU ``runtime.device_id`` names, or refused.

ONNX Runtime's Python ``InferenceSession`` retries a creation that raised (the
TensorRT EP's library missing, an option key its version does not know, a
device the host lacks) once with ``['CUDAExecutionProvider',
'CPUExecutionProvider']`` (``['CPUExecutionProvider']`` unless both GPU
providers were asked for) and *without the provider options*
(``onnxruntime_inference_collection.py``:
``self._create_inference_session(self._fallback_providers, None)``).  A CUDA EP
made without options runs on device 0: on a host with several GPUs and
``runtime.device_id`` 1, the model served on GPU 0, outside the memory budget
and the thermal watch of the GPU the daemon was given, and nothing said so but
the registered providers' options (``session.get_provider_options()``).

The same retry drops the CUDA EP's arena cap (``gpu_mem_limit``, SIZE_MAX
without it), on device 0 too: the session served, on a Jetson, with an arena
that grows to the largest request and keeps it.

``create_session`` reads them after every creation: a session with a GPU
provider on another device, or a CUDA EP whose arena options are not the
runtime's, is dropped and made again with the providers it registered and the
runtime's options for them, so on the configured device and capped.  A device
the host lacks then fails that provider too, and ONNX Runtime's retry of that
creation is the CPU alone (a degradation the provider check records, alerts and
refuses by configuration).  A session still on another device, or still
uncapped, is refused.  Left: the dropped session's CUDA EP did initialise
device 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inferd.errors import EngineDeserializeError
from inferd.runtime.ort_providers import off_device, uncapped


def create_session(
    ort: Any,
    model: Path | bytes,
    sess_options: Any,
    providers: Sequence[str],
    options: Mapping[str, Mapping[str, str]],
    *,
    device_id: int,
    what: str,
) -> Any:
    """A session of ``model`` (its path or its bytes) with ``providers`` (``options``
    by provider name), each GPU provider it registered on ``device_id`` and with the
    arena options asked for; ``what`` names the model in errors.  Raises
    ``EngineDeserializeError``."""
    session = _session(ort, model, sess_options, providers, options, what)
    if _options_lost(session.get_provider_options(), options, device_id):
        registered = list(session.get_providers())
        del session  # its memory goes before the next session takes its own
        session = _session(ort, model, sess_options, registered, options, what)
    registered_options = session.get_provider_options()
    elsewhere = off_device(registered_options, device_id)
    if elsewhere:
        placed = ", ".join(f"{name} on device {device}" for name, device in elsewhere.items())
        raise EngineDeserializeError(
            f"{what}: onnxruntime registered {placed} though runtime.device_id is "
            f"{device_id} and the session was made again with that device_id: refused (a "
            "model serves only on the GPU the daemon is given)"
        )
    unbounded = uncapped(registered_options, options)
    if unbounded:
        limits = ", ".join(
            f"{name} with gpu_mem_limit {limit} (asked {options[name].get('gpu_mem_limit')})"
            for name, limit in unbounded.items()
        )
        raise EngineDeserializeError(
            f"{what}: onnxruntime registered {limits} though the session was made again "
            "with the runtime's arena options: refused (an arena without the cap of "
            "runtime.ort_gpu_mem_limit_bytes grows to the largest request and keeps it)"
        )
    # ORT's Python wrapper otherwise retries a failing run on CPU behind our back.
    session.disable_fallback()
    # It keeps the bytes it was made from for that retry alone (``_model_bytes``,
    # "holding the memory indefinitely"): the model is not held twice while it serves.
    if isinstance(model, bytes) and getattr(session, "_model_bytes", None) is model:
        session._model_bytes = None
    return session


def _options_lost(
    registered: Mapping[str, Mapping[str, str]],
    options: Mapping[str, Mapping[str, str]],
    device_id: int,
) -> bool:
    """Whether a registered GPU provider runs elsewhere or without the arena options
    asked for (what ONNX Runtime's retry, which passes no options, does)."""
    return bool(off_device(registered, device_id) or uncapped(registered, options))


def _session(
    ort: Any,
    model: Path | bytes,
    sess_options: Any,
    providers: Sequence[str],
    options: Mapping[str, Mapping[str, str]],
    what: str,
) -> Any:
    try:
        return ort.InferenceSession(
            model if isinstance(model, bytes) else str(model),
            sess_options=sess_options,
            providers=list(providers),
            provider_options=[dict(options.get(name, {})) for name in providers],
        )
    except Exception as exc:  # ORT raises its own pybind exception types
        raise EngineDeserializeError(f"onnxruntime could not load {what}: {exc}") from exc
