"""``SharedRegion``'s lifetime and arguments (second review of the Python client): a
region dropped without ``close()`` kept its memfd open, and so all its memory, for
as long as the process; a size, shape or dtype it cannot take raised ``ValueError``
or numpy's ``TypeError`` instead of the library's ``InvalidArgument``."""

from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np
import pytest

from inferd_client import ClientError, InvalidArgument, SharedRegion


def memfds(label: str) -> list[str]:
    """This process's descriptors of memfds named ``inferd-<label>``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:inferd-{label} "):
            found.append(target)
    return found


def test_a_region_dropped_unclosed_releases_its_memfd_and_its_arrays_stay_usable() -> None:
    region = SharedRegion(1 << 20, label="dropped")
    array = region.array((1 << 18,), np.float32)
    array[:] = 3.0
    assert len(memfds("dropped")) == 2  # the region's, and the one its mapping holds
    del region
    gc.collect()
    # The mapping the array lives in stays until the array goes (no use after unmap).
    assert len(memfds("dropped")) == 1
    array += 1.0
    assert (array == 4.0).all()
    del array
    gc.collect()
    assert memfds("dropped") == []
    for _ in range(3):
        SharedRegion(1 << 20, label="dropped").array(4, np.uint8)[:] = 1
    gc.collect()
    assert memfds("dropped") == []


def test_a_region_that_is_not_positive_is_an_invalid_argument() -> None:
    for nbytes in (0, -4096):
        with pytest.raises(InvalidArgument, match="positive"):
            SharedRegion(nbytes)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        (3, object),
        (3, [("a", "O")]),
        (3, "S0"),
        ((2.5,), np.float32),
        ("ab", np.float32),
        (None, np.float32),
        (3, "no-such-dtype"),
    ],
    ids=["object", "object-field", "empty-item", "float-dim", "str-shape", "none", "bad-dtype"],
)
def test_an_array_the_region_cannot_hold_is_an_invalid_argument_and_takes_nothing(
    shape: Any, dtype: Any
) -> None:
    with SharedRegion(4096) as region:
        first = region.array(1, np.uint8)
        with pytest.raises(InvalidArgument):
            region.array(shape, dtype)
        after = region.array(1, np.uint8)
        assert region.locate(after) == (256, 1)  # the next aligned block: nothing taken
        del first, after


def test_numpy_integers_and_arrays_of_them_are_shapes() -> None:
    with SharedRegion(4096) as region:
        assert region.array(np.int64(3), np.float32).shape == (3,)
        assert region.array(np.array([2, 2]), np.float32).shape == (2, 2)
        assert region.array((np.int32(2), 1), np.uint8).shape == (2, 1)
        with pytest.raises(ClientError):
            region.array(np.array([[1]]), np.uint8)  # a shape's dims are integers
