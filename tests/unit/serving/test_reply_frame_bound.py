"""``oversized_frame``: which frame of a reply is over the request's bound, the
header's or an output's, by the output's name (region outputs have no frame)."""

from __future__ import annotations

import numpy as np

from inferd.serving.reply_tensors import oversized_frame

_PLACED = {"name": "in_region", "dtype": "float32", "shape": [1024], "region": "r", "offset": 0}


def test_the_first_output_frame_over_the_bound_is_named_past_outputs_in_regions() -> None:
    small, large = np.zeros(16, np.float32), np.zeros(1024, np.float32)
    descriptors = [
        _PLACED,
        {"name": "small", "dtype": "float32", "shape": [16]},
        {"name": "large", "dtype": "float32", "shape": [1024]},
    ]
    frames = [small, large]
    assert oversized_frame(b"h" * 100, descriptors, frames, 4096) is None
    assert oversized_frame(b"h" * 100, descriptors, frames, 4095) == (
        "output 'large' is 4096 bytes"
    )


def test_a_header_over_the_bound_is_named() -> None:
    assert oversized_frame(b"h" * 101, [], [], 100) == "the reply header is 101 bytes"
    assert oversized_frame(b"h" * 100, [], [], 100) is None
