"""``build.start`` whose build directory could not be checked (``EMFILE``, ``EIO``:
``UncheckedDirectoryError``) is refused ``UNAVAILABLE``, a condition that passes, not
``FAILED_PRECONDITION`` (an operator's to fix), as an unsafe one still is (review RB's
note on DESIGN.md 329).  Either way nothing starts."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from inferd.engine_build import supervisor
from inferd.errors import UncheckedDirectoryError, UnsafeDirectoryError
from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError
from tests.unit.engine_build.conftest import build_manager

OPERATOR = Peer("ipc", uid=os.getuid(), pid=os.getpid(), operator=True)


@pytest.mark.parametrize(
    ("refusal", "code"),
    [
        (
            UncheckedDirectoryError("could not be checked (EMFILE)", errno_code=errno.EMFILE),
            Code.UNAVAILABLE,
        ),
        (UnsafeDirectoryError("others may write it"), Code.FAILED_PRECONDITION),
    ],
    ids=["unchecked", "unsafe"],
)
def test_a_build_directory_that_could_not_be_checked_is_unavailable_not_a_precondition(
    tmp_path: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    refusal: UnsafeDirectoryError,
    code: Code,
) -> None:
    manager = build_manager(tmp_path, {"m": demo_model}, grace_s=1.0)

    def refused(path: Path, *, what: str) -> Path:
        raise refusal

    monkeypatch.setattr(supervisor, "ensure_owned_dir", refused)
    with pytest.raises(ProtocolError) as raised:
        manager.start({"model": "m", "builder": "simulated"}, OPERATOR)
    assert raised.value.code == code and str(refusal) in raised.value.message
    assert manager.status({})["builds"] == []  # nothing started or recorded
    manager.shutdown()
