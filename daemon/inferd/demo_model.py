"""Deterministic ONNX models built with ``onnx.helper``: the bundled demo
feature extractor and an identity model for transport benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from inferd.durable import atomic_write_bytes

if TYPE_CHECKING:
    import onnx

DEMO_SEED = 20261130
DEMO_INPUT = "image"
DEMO_OUTPUT = "descriptors"
DEMO_INPUT_SHAPE = (1, 3, 224, 224)
DEMO_OUTPUT_SHAPE = (1, 256, 28, 28)

# (out_channels, kernel, stride, pad): three stride-2 3x3 convolutions take
# 224 -> 28; a 1x1 convolution widens to 256 descriptor channels.
_LAYERS = ((32, 3, 2, 1), (64, 3, 2, 1), (128, 3, 2, 1), (256, 1, 1, 0))

# Opset 17 / IR 8 load on every ONNX Runtime >= 1.14, including JetPack 6 builds.
_OPSET = 17
_IR_VERSION = 8


def _save_atomically(model: onnx.ModelProto, path: Path) -> Path:
    import onnx

    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, model.SerializeToString())
    return path


def build_demo_model() -> onnx.ModelProto:
    """Conv+Relu feature extractor.

    ``image`` f32[1,3,224,224] -> ``descriptors`` f32[1,256,28,28].
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(DEMO_SEED)
    nodes = []
    initializers = []
    previous, channels = DEMO_INPUT, DEMO_INPUT_SHAPE[1]
    for index, (out_channels, kernel, stride, pad) in enumerate(_LAYERS):
        fan_in = channels * kernel * kernel
        weight = rng.normal(0.0, np.sqrt(2.0 / fan_in), (out_channels, channels, kernel, kernel))
        bias = rng.normal(0.0, 0.01, (out_channels,))
        initializers += [
            numpy_helper.from_array(weight.astype(np.float32), f"conv{index}.weight"),
            numpy_helper.from_array(bias.astype(np.float32), f"conv{index}.bias"),
        ]
        conv_out = f"conv{index}"
        relu_out = DEMO_OUTPUT if index == len(_LAYERS) - 1 else f"relu{index}"
        nodes += [
            helper.make_node(
                "Conv",
                [previous, f"conv{index}.weight", f"conv{index}.bias"],
                [conv_out],
                kernel_shape=[kernel, kernel],
                strides=[stride, stride],
                pads=[pad] * 4,
            ),
            helper.make_node("Relu", [conv_out], [relu_out]),
        ]
        previous, channels = relu_out, out_channels
    graph = helper.make_graph(
        nodes,
        "inferd_demo_features",
        [helper.make_tensor_value_info(DEMO_INPUT, TensorProto.FLOAT, DEMO_INPUT_SHAPE)],
        [helper.make_tensor_value_info(DEMO_OUTPUT, TensorProto.FLOAT, DEMO_OUTPUT_SHAPE)],
        initializers,
    )
    model = helper.make_model(
        graph, producer_name="inferd", opset_imports=[helper.make_opsetid("", _OPSET)]
    )
    model.ir_version = _IR_VERSION
    return model


def build_identity_model() -> onnx.ModelProto:
    """``input`` f32[batch,3,224,224] -> ``output`` (same bytes); batch is dynamic."""
    from onnx import TensorProto, helper

    shape: list[str | int | None] = ["batch", 3, 224, 224]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])],
        "inferd_identity",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(
        graph, producer_name="inferd", opset_imports=[helper.make_opsetid("", _OPSET)]
    )
    model.ir_version = _IR_VERSION
    return model


def write_demo_model(path: Path) -> Path:
    return _save_atomically(build_demo_model(), path)


def write_identity_model(path: Path) -> Path:
    return _save_atomically(build_identity_model(), path)
