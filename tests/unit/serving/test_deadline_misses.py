from __future__ import annotations

from pathlib import Path
from typing import Any

from inferd.config import ModelConfig
from inferd.fdr.kinds import validate
from inferd.serving.deadline_misses import DeadlineMissReporter
from inferd.serving.slot import ModelSlot


def test_one_summary_per_model_per_window(tmp_path: Path) -> None:
    slots = {
        name: ModelSlot(ModelConfig(name=name, path=tmp_path / f"{name}.onnx"))
        for name in ("a", "b")
    }
    records: list[tuple[str, dict[str, Any]]] = []
    now = [0.0]
    reporter = DeadlineMissReporter(
        slots,
        lambda kind, payload: records.append((kind, dict(payload))),
        window_s=10.0,
        clock=lambda: now[0],
    )
    for _ in range(3):
        slots["a"].stats.answered("DEADLINE_EXCEEDED")
    slots["b"].stats.answered("OK")
    now[0] = 5.0
    reporter.tick()
    assert records == [], "nothing before the window has elapsed"
    now[0] = 10.0
    reporter.tick()
    assert records == [("deadline_miss", {"model": "a", "count": 3, "window_s": 10.0})]
    validate(*records[0])
    slots["a"].stats.answered("DEADLINE_EXCEEDED")
    now[0] = 15.0
    reporter.flush()  # at shutdown: the partial window is reported too
    assert records[-1] == ("deadline_miss", {"model": "a", "count": 1, "window_s": 5.0})
    now[0] = 30.0
    reporter.tick()
    assert len(records) == 2, "no record for a window without misses"
