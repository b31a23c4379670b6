"""Dynamic shapes on ONNX Runtime's TensorRT EP: the model's profiles as EP options,
and the rule that no engine is ever built inside an inference.

The TensorRT EP keeps a shape range per dynamic input.  A request whose shape
falls outside it widens the range and rebuilds the engine inside
``session.run`` (onnxruntime ``tensorrt_execution_provider.cc``,
``ApplyProfileShapesFromInputTensorValue`` sets ``engine_update``): seconds to
minutes on a Jetson, on the engine worker.  Given explicit ranges
(``trt_profile_min_shapes``/``_opt_shapes``/``_max_shapes``, all three, format
``name:1x3x224x224,other:...``; onnxruntime #15546) for every dynamic input, the
EP builds at session creation and a request within them never rebuilds.  So:

* the model config's profiles (``[[models.profiles]]``) are checked against the
  model's inputs before a session exists (``check_model_profiles``), with the
  one profile rule of ``inferd.engines.build_config``, as the bytes the load hashed
  declare them (``ort_model_source.HashedModel.graph``);
* with the TensorRT EP requested, a dynamic input without a profile is refused
  (the first request of a new size would rebuild inside ``run``), and so is an
  input whose name the option format cannot carry: ONNX Runtime splits the
  options at ``,`` and each entry at its first ``:``, and drops malformed or
  inconsistent options with only a log warning (then builds inside ``run``);
* requests outside the profile never reach the runtime (``bus.codec``) and
  warm-up runs at the opt shape (``TensorSpec.warm_up_shape``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from inferd.engines.build_config import check_profiles, unprofiled_dynamic_inputs
from inferd.errors import EngineDeserializeError
from inferd.runtime.ort_model_source import HashedModel, ModelGraph, ModelParseError
from inferd.runtime.ort_precision import int8_refusal
from inferd.types import EngineCacheEntry, OptimizationProfile

#: Where an operator fixes what this module refuses.
CONFIG_KEY = "[[models.profiles]]"
#: The separators of ONNX Runtime's ``trt_profile_*_shapes`` format.
_OPTION_SEPARATORS = (",", ":")


def check_before_session(
    entry: EngineCacheEntry, model: HashedModel, *, tensorrt_ep: bool
) -> dict[str, OptimizationProfile]:
    """The load's decisions on ``entry``'s model before any session exists, from the
    graph of ``model`` (read only if one needs it: not for fp32 without profiles and
    without the TensorRT EP): for the TensorRT EP, INT8 only for a Q/DQ model
    (``ort_precision``, first: the one parse then looks for Q/DQ nodes too), then the
    profiles (``check_model_profiles``), returned by input name.  Raises
    ``EngineDeserializeError``."""
    graph = model.graph
    # A staged engine was built with its precision (the gate checks the build
    # config): the TensorRT EP builds nothing and needs no INT8 scales.
    if tensorrt_ep and not entry.staged_engines:
        refused = int8_refusal(entry.model_path, entry.build_config.precision, model.quantized)
        if refused is not None:
            raise EngineDeserializeError(refused)
    profiles = entry.build_config.profiles
    if not (profiles or tensorrt_ep):
        return {}
    return check_model_profiles(entry.model_path, profiles, tensorrt_ep=tensorrt_ep, graph=graph)


def model_inputs(model_path: Path, graph: Callable[[], ModelGraph]) -> ModelGraph:
    """``model_path``'s graph as ``graph`` reads it (from the bytes the load hashed,
    without external data: ``ort_model_source.HashedModel.graph``);
    ``EngineDeserializeError`` when those bytes are not an ONNX model."""
    try:
        return graph()
    except ModelParseError as exc:
        raise EngineDeserializeError(
            f"could not load {model_path} to read its inputs: {exc}"
        ) from exc


def check_model_profiles(
    model_path: Path,
    profiles: Sequence[OptimizationProfile],
    *,
    tensorrt_ep: bool,
    graph: Callable[[], ModelGraph],
) -> dict[str, OptimizationProfile]:
    """``profiles`` by input name, checked against ``model_path``'s inputs (read by
    ``graph``, ``model_inputs``); with ``tensorrt_ep`` also that every dynamic input
    has one and that each name fits the EP's option format.  Raises
    ``EngineDeserializeError`` naming the input and the config key; nothing has been
    created yet."""
    inputs = model_inputs(model_path, graph).inputs
    try:
        by_name = check_profiles(inputs, profiles)
    except ValueError as exc:
        raise EngineDeserializeError(f"{model_path}: {CONFIG_KEY}: {exc}") from None
    if not tensorrt_ep:
        return by_name
    missing = unprofiled_dynamic_inputs(inputs, profiles)
    if missing:
        described = ", ".join(f"{name!r} {shape}" for name, shape in missing.items())
        raise EngineDeserializeError(
            f"{model_path}: input(s) {described} have dynamic dimensions and no optimisation "
            f"profile: ONNX Runtime's TensorRT EP would rebuild its engine inside an inference "
            f"for each new shape. Give each a {CONFIG_KEY} entry (input_name, min_shape, "
            "opt_shape, max_shape) in the daemon config"
        )
    for name in by_name:
        if any(separator in name for separator in _OPTION_SEPARATORS):
            raise EngineDeserializeError(
                f"{model_path}: input {name!r} has a profile ({CONFIG_KEY}) but its name "
                "cannot be passed to ONNX Runtime's TensorRT EP: trt_profile_*_shapes "
                "separate inputs with ',' and a name from its shape with ':'. Rename the "
                "input in the model, or serve it on the tensorrt runtime"
            )
    return by_name


def profile_options(profiles: Sequence[OptimizationProfile]) -> dict[str, str]:
    """The TensorRT EP's explicit profile options (all three or none)."""
    if not profiles:
        return {}

    def shapes(pick: str) -> str:
        return ",".join(
            f"{profile.input_name}:{'x'.join(str(dim) for dim in getattr(profile, pick))}"
            for profile in profiles
        )

    return {
        "trt_profile_min_shapes": shapes("min_shape"),
        "trt_profile_opt_shapes": shapes("opt_shape"),
        "trt_profile_max_shapes": shapes("max_shape"),
    }
