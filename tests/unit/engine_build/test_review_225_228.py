"""Review of entries 225 and 227.

225: validation's reference run on a thread of its own keeps a failed or cancelled
run's session (the model's weights) alive in a reference cycle (below).

227 (``build.start`` refuses ``simulation.fail: null`` as its schema does).  The
same mismatch remains one level up: ``build.start``'s ``simulation``,
``build_config`` and ``timeout_s`` are typed ``object`` / ``object`` / ``number`` by
``schemas/bus/control_request.json`` (null is no value of those), yet
``parse_start`` reads ``header.get(key)`` and takes a null for an absent key: the
build starts, with the model's build config and ``builds.max_duration_s``."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from inferd.config import ModelConfig
from inferd.engine_build import validation
from inferd.engine_build.build_args import parse_start
from inferd.engine_build.cancel import CancellationToken
from inferd_wire.protocol import Code, ProtocolError
from tests.integration.test_schemas import assert_invalid, assert_valid

MAX_DURATION_S = 14400.0


@pytest.mark.parametrize("key", ["simulation", "build_config", "timeout_s"])
def test_build_start_refuses_a_null_argument_its_schema_refuses(tmp_path: Path, key: str) -> None:
    model = tmp_path / "demo.onnx"
    model.write_bytes(b"model")  # parse_start only checks that it is a file
    models = {"demo": ModelConfig(name="demo", path=model)}
    header = {"v": 1, "id": 5, "op": "build.start", "model": "demo", "builder": "simulated"}
    assert_valid("control_request.json", header)
    parse_start(header, models, lambda: False, MAX_DURATION_S)  # the header itself is fine
    with_null = {**header, key: None}
    assert_invalid("control_request.json", with_null)
    with pytest.raises(ProtocolError) as refused:
        parse_start(with_null, models, lambda: False, MAX_DURATION_S)
    assert refused.value.code is Code.INVALID_ARGUMENT


# -- 225: the reference run's thread ------------------------------------------------


class _Output:
    name = "y"


class _FailingSession:
    """An ONNX Runtime session whose ``run`` raises (as a terminated run does), after
    ``during_run`` (a cancel, here)."""

    def __init__(self, during_run: Any) -> None:
        self._during_run = during_run

    def get_outputs(self) -> list[_Output]:
        return [_Output()]

    def run(self, _names: Any, _inputs: Any, _options: Any) -> Any:
        self._during_run()
        raise RuntimeError("Exiting due to terminate flag being set to true.")


@pytest.mark.parametrize("cancelled", [False, True], ids=["run failed", "run cancelled"])
def test_a_failed_or_cancelled_reference_run_lets_go_of_its_session(cancelled: bool) -> None:
    """The reference session holds the model's weights (hundreds of MB).  Since 225
    the run's outcome is kept in a list the thread's frame closes over, and the
    exception is raised again from the waiting frame: the exception's traceback holds
    that frame, which holds the list (or ``outcome``), which holds the exception.
    The session then outlives the build's handling of the failure until the cyclic
    GC runs (before 225: freed as soon as the exception was handled)."""
    token = CancellationToken()
    session = _FailingSession(
        (lambda: token.cancel("control", "operator")) if cancelled else (lambda: None)
    )
    alive = weakref.ref(session)
    expected = validation.ValidationCancelled if cancelled else RuntimeError
    collecting = gc.isenabled()
    gc.disable()  # what is freed must be freed by its count, not by a GC pass
    try:
        try:
            validation._run_cancellable(session, {}, token)
        except expected:
            pass
        else:
            raise AssertionError("the run did not fail")
        del session
        assert alive() is None, "the reference session outlived the handled failure"
    finally:
        if collecting:
            gc.enable()
