"""``runtime.switch``'s ``requested_by`` is recorded as sent (the FDR's
``runtime_switch`` record, the journal): one that is not printable is refused
``INVALID_ARGUMENT`` naming the character, before anything is taken (no rate
token, no claim, no preparation, no record).  It was checked for its length only:
an OSC 52 or a forged "\\r\\n" line went into the record."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest

from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S
from tests.unit.client.test_review_free_text_wire import FORBIDDEN, PRINTABLE, refusal
from tests.unit.serving.test_switch_rate import ALICE, Rig
from tests.unit.serving.test_switch_refusals import answered_switch


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


@pytest.mark.parametrize("text", FORBIDDEN.values(), ids=FORBIDDEN.keys())
def test_a_requested_by_that_is_not_printable_is_refused_before_anything(
    rig: Rig, text: str
) -> None:
    replies: queue.Queue[Any] = queue.Queue()
    header = {"model": "m", "runtime": "tensorrt", "requested_by": text}
    with pytest.raises(ProtocolError) as refused:
        rig.switcher.switch(header, ALICE, replies.put)
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert refused.value.message == refusal("requested_by", text)
    assert replies.empty() and rig.prepared == 0 and rig.records == []
    assert rig.switcher.claim("m"), "the refused switch claimed the model"
    rig.switcher.unclaim("m")
    # The peer's whole burst (2) is left: the refusal took no token.
    assert [answered_switch(rig.switcher, ALICE, "m").code for _ in range(2)] == [
        Code.FAILED_PRECONDITION
    ] * 2
    assert rig.prepared == 2 and rig.switcher.rate.refused == 0


def test_a_printable_requested_by_in_any_script_is_taken(rig: Rig) -> None:
    replies: queue.Queue[Any] = queue.Queue()
    rig.switcher.switch(
        {"model": "m", "runtime": "tensorrt", "requested_by": PRINTABLE[0]}, ALICE, replies.put
    )
    reply = replies.get(timeout=HANG_S)  # prepared, and refused by the preparation
    assert isinstance(reply, ProtocolError) and reply.code is Code.FAILED_PRECONDITION
    assert rig.prepared == 1
