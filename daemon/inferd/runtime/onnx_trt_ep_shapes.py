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
  one profile rule of ``inferd.engines.build_config``;
* with the TensorRT EP requested, a dynamic input without a profile is refused
  (the first request of a new size would rebuild inside ``run``), and so is an
  input whose name the option format cannot carry: ONNX Runtime splits the
  options at ``,`` and each entry at its first ``:``, and drops malformed or
  inconsistent options with only a log warning (then builds inside ``run``);
* requests outside the profile never reach the runtime (``bus.codec``) and
  warm-up runs at the opt shape (``TensorSpec.warm_up_shape``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inferd.engines.build_config import check_profiles, unprofiled_dynamic_inputs
from inferd.errors import EngineDeserializeError
from inferd.types import OptimizationProfile

#: Where an operator fixes what this module refuses.
CONFIG_KEY = "[[models.profiles]]"
#: The separators of ONNX Runtime's ``trt_profile_*_shapes`` format.
_OPTION_SEPARATORS = (",", ":")


def model_without_weights(model_path: Path) -> Any:
    """``model_path``'s ``onnx.ModelProto`` without its external data files, to read
    its inputs; ``EngineDeserializeError`` when it cannot be read."""
    import onnx

    try:
        return onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ...
        raise EngineDeserializeError(
            f"could not load {model_path} to read its inputs: {exc}"
        ) from exc


def graph_input_shapes(model_path: Path) -> dict[str, list[int | None]]:
    """The model's inputs (initializers excluded, as ONNX Runtime's ``get_inputs``)
    with ``None`` for a dynamic dimension, read without the weights."""
    model = model_without_weights(model_path)
    initializers = {tensor.name for tensor in model.graph.initializer}
    shapes: dict[str, list[int | None]] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [
            dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None
            for dim in dims
        ]
    return shapes


def check_model_profiles(
    model_path: Path, profiles: Sequence[OptimizationProfile], *, tensorrt_ep: bool
) -> dict[str, OptimizationProfile]:
    """``profiles`` by input name, checked against ``model_path``'s inputs; with
    ``tensorrt_ep`` also that every dynamic input has one and that each name fits
    the EP's option format.  Raises ``EngineDeserializeError`` naming the input and
    the config key; nothing has been created yet."""
    inputs = graph_input_shapes(model_path)
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
