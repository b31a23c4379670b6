"""Each log line is bounded, in every format: a string field longer than
``MAX_FIELD_CHARS`` (a refusal quoting what a client sent) is cut, saying how long
it was; a traceback, added after, is not.  The journald writer queues up to 4096
entries while journald does not read, each holding its fields (DESIGN.md 141)."""

from __future__ import annotations

import json

import pytest
import structlog

from inferd.supervision import logging as inferd_logging
from inferd.supervision.logging import MAX_FIELD_CHARS, configure_logging
from tests.unit.supervision.conftest import as_dict

pytestmark = pytest.mark.systemd

QUOTED = "unknown control op " + repr("\x01" * 60_000)


def test_a_huge_field_is_cut_in_the_journal_and_a_traceback_is_not() -> None:
    entries: list[dict[str, list[str]]] = []
    configure_logging("info", "journald", sender=lambda f: entries.append(as_dict(list(f))))
    logger = structlog.get_logger("test")
    logger.info("request_refused", code="INVALID_ARGUMENT", reason=QUOTED)
    try:
        raise RuntimeError("x" * (2 * MAX_FIELD_CHARS))
    except RuntimeError:
        logger.exception("request_handler_failed")
    assert inferd_logging.flush_journal(5)
    refused, failed = entries
    [reason] = refused["INFERD_REASON"]
    assert len(reason) < MAX_FIELD_CHARS + 64
    assert reason.startswith(QUOTED[:100]) and reason.endswith(f"[cut: {len(QUOTED)} characters]")
    assert sum(map(len, failed["MESSAGE"])) > 2 * MAX_FIELD_CHARS  # the traceback whole


def test_a_huge_field_is_cut_in_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    structlog.get_logger("t").info("request_refused", code="NOT_FOUND", reason=QUOTED)
    line = capsys.readouterr().err.strip()
    assert len(line) < 2 * MAX_FIELD_CHARS
    assert json.loads(line)["reason"].endswith(f"[cut: {len(QUOTED)} characters]")
