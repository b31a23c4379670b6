"""Three errors of the request path a review found unclear or wrong (third review
of the request path, finding 3), on the real dispatcher, router, slot (the
identity model on ONNX Runtime's CPU provider) and scheduler of a daemon with
``[shm] enabled = false``:

- a dimension over the bound is refused naming the bound (2147483647), not as
  if it were negative;
- an empty ``outputs`` names no region: admitted, where it was refused
  ``NOT_FOUND`` ("this daemon serves no shared-memory regions");
- a fractional ``deadline_ms`` is rounded up (1.9 is 2 ms), never truncated to
  a shorter deadline than the client asked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from inferd.bus.headers import decode_infer
from inferd.bus.request_options import deadline_ms_of
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from tests.unit.serving.test_frames_repeats import SHAPE, Serving, message

#: Read as a typed header, or (an unknown key: the typed decoder gives up) as a
#: dict by the reference checks.
PATHS = {"typed": {}, "dict": {"x-unknown": 1}}


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[Serving]:
    served = Serving(tmp_path)
    yield served
    served.close()


def header(**extra: Any) -> bytes:
    fields: dict[str, Any] = {
        "v": 1,
        "op": "infer",
        "model": "identity",
        "inputs": [{"name": "input", "dtype": "float32", "shape": SHAPE}],
        **extra,
        "id": 1,
    }
    return msgpack.packb(fields, use_bin_type=True)  # type: ignore[no-any-return]


def test_a_dimension_over_the_bound_is_refused_naming_the_bound(serving: Serving) -> None:
    shape = [2**31, 1, 1, 1]
    with pytest.raises(ProtocolError) as caught:
        protocol.parse_descriptor(0, {"name": "input", "dtype": "float32", "shape": shape})
    assert caught.value.code is Code.INVALID_ARGUMENT
    assert "up to 2147483647" in caught.value.message
    # As the bus answers it (the typed decoder refuses it, the reference checks say why).
    inputs = [{"name": "input", "dtype": "float32", "shape": shape}]
    refusal = serving.refusal(message(header(inputs=inputs), np.zeros(1, np.float32)))
    assert refusal["error"]["code"] == "INVALID_ARGUMENT"
    assert refusal["error"]["message"] == (
        "tensor 'input': shape [2147483648, 1, 1, 1] must hold non-negative integers "
        "up to 2147483647"
    )
    # The bound itself is a dimension.
    largest = {"name": "input", "dtype": "float32", "shape": [2**31 - 1]}
    assert protocol.parse_descriptor(0, largest)[2] == (2**31 - 1,)


@pytest.mark.parametrize("path", PATHS)
def test_an_empty_outputs_names_no_region_without_shm(serving: Serving, path: str) -> None:
    frame = header(outputs=[], **PATHS[path])
    assert (decode_infer(frame) is None) is (path == "dict")
    job = serving.admit(message(frame, np.ones(SHAPE, np.float32)))
    assert job.regions is None and job.inputs is not None
    job.finish()
    # A list is still required: anything else is refused as before.
    refusal = serving.refusal(message(header(outputs={}), np.ones(SHAPE, np.float32)))
    assert refusal["error"]["code"] == "INVALID_ARGUMENT", refusal


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("asked", "kept_ms"), [(1.9, 2), (0.4, 1), (1e-300, 1), (2.0, 2), (2, 2), (2.000001, 3)]
)
def test_a_fractional_deadline_is_rounded_up(
    serving: Serving, path: str, asked: float, kept_ms: int
) -> None:
    frame = header(deadline_ms=asked, **PATHS[path])
    typed = decode_infer(frame)
    assert (typed is None) is (path == "dict")
    parsed = protocol.unpack_header(frame) if typed is None else typed
    assert deadline_ms_of(parsed, 0) == kept_ms
    job = serving.admit(message(frame, np.ones(SHAPE, np.float32)))
    assert job.deadline_ns is not None
    assert job.deadline_ns - job.received_ns == kept_ms * 1_000_000
    job.finish()
