"""The self-test's load generator (``inferd.selftest.load``) against a real daemon that
refuses every request at once: the failures are counted, but only the first few
messages are kept, however long the load runs (a failed model must not make the
self-test hold one string per refused request)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from inferd.selftest.load import FAILURES_KEPT, client_load
from inferd_client import OperatorClient
from tests.conftest import DaemonProcess, wait_until

pytestmark = pytest.mark.integration

#: Far more refusals than messages kept: what a failed model's load sends in a second.
REFUSALS = 20 * FAILURES_KEPT


def _refused(daemon: DaemonProcess) -> int:
    with OperatorClient(daemon.control, timeout=10) as operator:
        (model,) = operator.status()["models"]
    return int(model["responses"].get("INVALID_ARGUMENT", 0))


def test_a_load_refused_at_once_keeps_a_bounded_list_of_failures(daemon: DaemonProcess) -> None:
    def wrong_shape(_rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"image": np.zeros((1, 3, 2, 2), np.float32)}  # outside the model's shape

    def never_called(_inputs: Any, _outputs: Any) -> bool:
        raise AssertionError("no request is answered")

    with client_load(daemon.infer, "demo", wrong_shape, never_called, clients=2) as load:
        wait_until(lambda: _refused(daemon) >= REFUSALS, message=f"{REFUSALS} refusals")
    assert load.answered() == 0
    assert load.failed >= REFUSALS
    assert 0 < len(load.failures) <= FAILURES_KEPT, len(load.failures)
    assert all("INVALID_ARGUMENT" in failure for failure in load.failures[:5])
