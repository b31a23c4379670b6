"""Each delivered alert is one journal line, whatever the number of models it
is raised for: the log's repeat limiter keys on (event, model, code), and the
dispatcher now logs the alert's own model at the top level.  Before, the model
was only inside ``alert_fields``: on a thread with no model bound (a rebuild, a
switch, the main thread) the 6th and later models' ``alert`` lines of one code
within 10 s were dropped, counted in a summary that named no model."""

from __future__ import annotations

import structlog

from inferd.alerts import AlertDispatcher
from inferd.repeat_limiter import RepeatLimiter
from inferd.supervision import logging as inferd_logging
from inferd.supervision.logging import configure_logging
from inferd.types import Alert
from tests.unit.alerts.conftest import RecordingHook
from tests.unit.supervision.conftest import as_dict


def test_one_codes_alerts_for_eight_models_are_eight_journal_lines() -> None:
    entries: list[dict[str, list[str]]] = []
    configure_logging(
        "info",
        "journald",
        sender=lambda fields: entries.append(as_dict(list(fields))),
        limiter=RepeatLimiter(),  # the daemon's: 5 lines a key per 10 s
    )
    hook = RecordingHook()
    try:
        dispatcher = AlertDispatcher([hook], rate_limit_s=10.0)
        for index in range(8):
            fields = {"model": f"cam{index}", "build_id": None}
            dispatcher(Alert("WARNING", "engine_build_failed", f"cam{index} failed", fields))
        # A model bound on the thread (the engine worker's) does not hide the alert's own.
        with structlog.contextvars.bound_contextvars(model="cam0"):
            dispatcher(Alert("WARNING", "engine_build_failed", "cam8 failed", {"model": "cam8"}))
        inferd_logging.flush_suppressed(ended_only=False)
        assert inferd_logging.flush_journal(5)
    finally:
        inferd_logging._limiter = RepeatLimiter()
    assert [call[3]["model"] for call in hook.calls] == [f"cam{index}" for index in range(9)]
    alerts = [entry for entry in entries if entry["INFERD_EVENT"] == ["alert"]]
    # before: cam0..cam4, then a log_repeats_suppressed of 4 with no model
    assert [entry["INFERD_MODEL"] for entry in alerts] == [[f"cam{index}"] for index in range(9)]
    assert {code for entry in alerts for code in entry["INFERD_CODE"]} == {"engine_build_failed"}
    summaries = [entry for entry in entries if entry["INFERD_EVENT"] == ["log_repeats_suppressed"]]
    assert summaries == []
