"""``refuse_unfit_outputs``: an output whose static shape is over the request's
bound is refused before the run; a dynamic one, or one placed in a region, is not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from inferd.serving.reply_tensors import refuse_unfit_outputs
from inferd.types import TensorSpec
from inferd_wire.protocol import Code, ProtocolError

_STATIC = TensorSpec("static", "float32", (1, 256))  # 1,024 bytes
_DYNAMIC = TensorSpec("dynamic", "float64", (None, 4096))


def test_a_static_output_over_the_bound_is_refused_by_name() -> None:
    with pytest.raises(ProtocolError) as refused:
        refuse_unfit_outputs((_DYNAMIC, _STATIC), None, 1023)
    assert refused.value.code == Code.RESOURCE_EXHAUSTED
    assert refused.value.message.startswith("output 'static' is 1024 bytes, over this request's")
    refuse_unfit_outputs((_DYNAMIC, _STATIC), None, 1024)  # fits exactly


def test_dynamic_and_placed_outputs_are_left_to_the_run() -> None:
    placed: Any = SimpleNamespace(outputs=[SimpleNamespace(name="static")])
    refuse_unfit_outputs((_DYNAMIC, _STATIC), placed, 1)
