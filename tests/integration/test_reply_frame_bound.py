"""A client's bound on its reply frames, told to a real daemon
(``max_reply_frame_bytes`` in the infer request, DESIGN.md 248): a reply with a
frame over it is answered ``RESOURCE_EXHAUSTED`` naming the frame and the bound,
after one run whatever the client's retries, and the connection stays up;
outputs the daemon writes into the client's regions are no frames and are not
bounded by it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from inferd_client import InferenceClient, OperatorClient, RemoteError
from tests.conftest import DaemonFactory, DaemonProcess
from tests.integration.wire import IDENTITY_SHAPE

pytestmark = pytest.mark.integration

#: One identity output of batch 1 (602,112 bytes) fits, one of batch 2 does not.
_BOUND = 700_000


def _model_counts(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=5) as operator:
        status = operator.status()
    entry = next(m for m in status["models"] if m["model"] == "identity")
    return {"requests": entry["requests"], **entry["responses"]}


def test_a_reply_over_the_clients_bound_is_refused_by_name_after_one_run(
    identity_daemon: DaemonProcess,
) -> None:
    one = np.full(IDENTITY_SHAPE, 1.5, np.float32)
    two = np.concatenate([one, one])
    with InferenceClient(
        identity_daemon.infer, timeout=10, retries=2, max_reply_frame_bytes=_BOUND
    ) as client:
        assert np.array_equal(client.infer("identity", {"input": one})["output"], one)
        before = _model_counts(identity_daemon)
        with pytest.raises(RemoteError) as refused:
            client.infer("identity", {"input": two})
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        assert refused.value.message == (
            f"output 'output' is {two.nbytes} bytes, over this request's "
            f"max_reply_frame_bytes = {_BOUND}; nothing was sent"
        )
        after = _model_counts(identity_daemon)
        # Run once, not once per retry, and counted as what it was answered.
        assert after["requests"] - before["requests"] == 1
        assert after.get("RESOURCE_EXHAUSTED", 0) - before.get("RESOURCE_EXHAUSTED", 0) == 1
        assert client.connections_lost == 0
        assert np.array_equal(client.infer("identity", {"input": one})["output"], one)


def test_outputs_written_into_regions_are_not_bounded_by_it(
    identity_daemon: DaemonProcess,
) -> None:
    with InferenceClient(identity_daemon.infer, timeout=10, max_reply_frame_bytes=_BOUND) as client:
        region = client.shared_region(8 << 20)
        shape = (2, *IDENTITY_SHAPE[1:])
        source = region.array(shape, np.float32)
        source[...] = 2.5
        target = region.array(shape, np.float32)
        result = client.infer("identity", {"input": source}, outputs={"output": target})
        assert result["output"] is target and np.array_equal(target, source)
        assert target.nbytes > _BOUND


def test_a_static_output_over_the_bound_is_refused_before_the_run(
    daemon_factory: DaemonFactory,
) -> None:
    """The demo's output has no dynamic dimension: its 802,816 bytes are known at
    admission, so the request is refused there, not run for a reply it cannot take."""
    daemon = daemon_factory()
    image = np.zeros((1, 3, 224, 224), np.float32)
    with InferenceClient(daemon.infer, timeout=10, max_reply_frame_bytes=100_000) as client:
        with pytest.raises(RemoteError) as refused:
            client.infer("demo", {"image": image})
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        assert refused.value.message == (
            "output 'descriptors' is 802816 bytes, over this request's "
            "max_reply_frame_bytes = 100000; the request was not run"
        )
        region = client.shared_region(4 << 20)
        source, target = (
            region.array(image.shape, np.float32),
            region.array((1, 256, 28, 28), np.float32),
        )
        source[...] = image
        # Placed in a region, the same output is no frame: served.
        assert (
            client.infer("demo", {"image": source}, outputs={"descriptors": target})["descriptors"]
            is target
        )
