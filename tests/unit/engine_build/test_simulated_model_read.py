"""The SIMULATED builder builds from the model bytes the build hashed, read once
(``engine_build.model_source.ModelSource``), as ``TensorRTBuilder`` does: a model
replaced after the build hashed it fails the build with ``ModelChangedError``'s
words instead of timing one model's nodes under another's digest, and a FIFO at
the model path is refused at once instead of holding the build until its deadline.

Each FIFO read runs on a thread joined with a bound (a regression fails instead of
hanging); a still-blocked open is released by a writer that comes and goes."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from inferd.digest import model_digest
from inferd.engine_build import BuildRequest, run_build
from inferd.engine_build.events import BuildEvent
from inferd.engine_build.simulated import ENGINE_MAGIC, SimSettings, SimulatedBuilder
from inferd.model_bytes import parse_model
from inferd.types import BuildConfig
from tests.conftest import raised_without_waiting
from tests.unit.engine_build.conftest import HOST


def _nodes(model: Path) -> list[str]:
    graph = parse_model(model.read_bytes()).graph
    return [f"{node.op_type}_{index}" for index, node in enumerate(graph.node)]


def _build(
    model: Path, builder: SimulatedBuilder, engine: Path
) -> tuple[dict[str, Any], list[BuildEvent]]:
    """``run_build`` as the build child runs it: the request names the builder's digest."""
    events: list[BuildEvent] = []
    request = BuildRequest(model, engine, BuildConfig(), HOST, model_sha256=builder.model_sha)
    report = run_build(request, builder, record=None, listener=events.append)
    return report.summary, events


def test_the_engine_carries_the_hashed_bytes_and_times_their_nodes(
    tmp_path: Path, demo_model: Path
) -> None:
    model = Path(shutil.copy(demo_model, tmp_path / "model.onnx"))
    builder = SimulatedBuilder(model, BuildConfig(), HOST, settings=SimSettings(step_s=0))
    assert builder.model_sha == model_digest(model).sha256
    summary, events = _build(model, builder, tmp_path / "out" / "m.engine")
    assert summary["outcome"] == "completed", summary.get("error")
    engine = (tmp_path / "out" / "m.engine").read_bytes()
    carried = engine[len(ENGINE_MAGIC) :].partition(b"\n")[2]
    assert hashlib.sha256(carried).hexdigest() == builder.model_sha
    started = [e.name or "" for e in events if e.type == "phase_start"]
    timed = {name.removeprefix("Timing node ") for name in started if name.startswith("Timing")}
    assert timed == set(_nodes(model))


def test_a_model_replaced_after_it_was_hashed_fails_the_build_saying_so(
    tmp_path: Path, demo_model: Path, identity_model: Path
) -> None:
    model = Path(shutil.copy(demo_model, tmp_path / "model.onnx"))
    builder = SimulatedBuilder(model, BuildConfig(), HOST, settings=SimSettings(step_s=0))
    hashed = builder.model_sha
    model.write_bytes(identity_model.read_bytes())  # an operator's cp over it
    summary, events = _build(model, builder, tmp_path / "out" / "m.engine")
    assert summary["outcome"] == "failed"
    assert summary["error"].startswith(f"the model {model} changed during the build: its digest ")
    assert f"the engine is named for {hashed[:16]}" in summary["error"]
    # Refused before timing anything: no node of either model was timed.
    assert not [e for e in events if (e.name or "").startswith("Timing node")]
    assert not (tmp_path / "out" / "m.engine").exists()


def test_a_fifo_as_the_model_is_refused_at_once_when_the_builder_is_made(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo, 0o600)
    outcome = raised_without_waiting(lambda: SimulatedBuilder(fifo, BuildConfig(), HOST), fifo)
    assert isinstance(outcome, OSError), outcome
    assert str(fifo) in str(outcome) and "is not a regular file" in str(outcome)


def test_a_fifo_swapped_in_after_the_hash_fails_the_build_at_once(
    tmp_path: Path, demo_model: Path
) -> None:
    model = Path(shutil.copy(demo_model, tmp_path / "model.onnx"))
    builder = SimulatedBuilder(model, BuildConfig(), HOST, settings=SimSettings(step_s=0))
    model.unlink()
    os.mkfifo(model, 0o600)
    results: list[tuple[dict[str, Any], list[BuildEvent]]] = []
    outcome = raised_without_waiting(
        lambda: results.append(_build(model, builder, tmp_path / "out" / "m.engine")), model
    )
    assert outcome is None, outcome
    summary, _ = results[0]
    assert summary["outcome"] == "failed"
    assert (
        summary["error"] == f"cannot read model.onnx: [Errno 22] is not a regular file: '{model}'"
    )
