"""``inferd build``'s progress shows the timing-cache decision the build starts with,
which the child puts on its first event (DESIGN.md 283), in both displays."""

from __future__ import annotations

import io
from typing import Any

from inferd.cli.build_progress import LiveProgress, PlainProgress
from inferd.engine_build.events import BuildEvent


def event(seq: int, kind: str, phase: str | None, **detail: Any) -> BuildEvent:
    return BuildEvent(
        build_id="b1",
        seq=seq,
        type=kind,
        phase_id=phase,
        parent_id=None,
        name="Building engine" if phase else None,
        step=None,
        num_steps=4 if kind == "phase_start" else None,
        mono_ns=seq,
        wall_ns=seq,
        thread="MainThread",
        cancel_state="none",
        detail=detail,
    )


EVENTS = [
    event(1, "phase_start", "p1", timingCacheMode="reused"),
    event(2, "phase_finish", "p1"),
]


def test_the_plain_display_names_it_on_the_first_events_line_only() -> None:
    out = io.StringIO()
    display = PlainProgress(out)
    for each in EVENTS:
        display(each)
    assert out.getvalue().splitlines() == [
        "start     Building engine (4 steps)  (timing cache at start: reused)",
        "finish    Building engine [finished_early 0/4]",
    ]


def test_the_live_display_names_it_in_its_title() -> None:
    display = LiveProgress(io.StringIO(), "build demo")
    try:
        assert "timing cache" not in str(display._render().label)
        display(EVENTS[0])
        assert (
            str(display._render().label) == "build demo  [running]  timing cache at start: reused"
        )
    finally:
        display.close()
