"""An ancestor of the daemon's directory whose ``stat`` fails for a reason not about
it (``EIO``, ``ENOMEM``) is no verdict on the directory (DESIGN.md entry 309's rule).

``unsafe_ancestor_reason`` read any failed ``stat`` of an ancestor as "has an
ancestor X that cannot be examined (Input/output error)": ``ensure_owned_dir``
raised ``UnsafeDirectoryError`` (``inferd run`` exits 2, never retried, no
``ERRNO=``) and ``load_clients`` a config error (exit 2), for a state of the
system at the time.  Now a check that asks (``raise_unchecked``) gets the
``OSError``, and the daemon's callers say "could not be checked (EIO: ..., at
<ancestor>)" with the errno kept; what is about the ancestor (``EACCES``) stays
unsafe.  ``os.stat`` is failed for that one ancestor alone, in this process."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from inferd.bus.curve_keys import load_clients
from inferd.cli.main import _cannot_start
from inferd.errors import ConfigError, UncheckedDirectoryError, UnsafeDirectoryError
from inferd.owned_files import ensure_owned_dir, unsafe_owned_dir_reason
from inferd.supervision.notify import Notifier, errno_of
from inferd_wire.endpoints import unsafe_ancestor_reason


def _exit_of(error: Exception) -> int:
    """``inferd run``'s exit status for ``error`` at start (no ``$NOTIFY_SOCKET``)."""
    return _cannot_start(Notifier.from_environment({}), "inferd.toml", error)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    made = tmp_path / "state"
    made.mkdir(mode=0o750)
    return made


def _fail_stat_of(monkeypatch: pytest.MonkeyPatch, ancestor: Path, code: int) -> list[str]:
    """``os.stat`` of ``ancestor`` fails with ``code`` (as the kernel's would: the
    path in ``filename``); any other is the real one.  Returns what it failed."""
    real_stat = os.stat
    failed: list[str] = []

    def stat_failing(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if not isinstance(path, int) and os.fspath(path) == str(ancestor):
            failed.append(str(path))
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat_failing)
    return failed


def _parent(directory: Path) -> Path:
    return Path(os.path.realpath(directory)).parent  # the ancestors are the real path's


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOMEM])
def test_an_ancestor_that_could_not_be_examined_is_unchecked_not_unsafe(
    directory: Path, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``UnsafeDirectoryError`` "has an ancestor ... that cannot be examined"."""
    parent = _parent(directory)
    failed = _fail_stat_of(monkeypatch, parent, code)
    with pytest.raises(UnsafeDirectoryError) as raised:  # refused where unsafe ones are
        ensure_owned_dir(directory, what="daemon.state_dir")
    assert failed == [str(parent)]
    assert type(raised.value) is UncheckedDirectoryError
    assert raised.value.errno == code
    assert str(raised.value) == (
        f"daemon.state_dir {directory} could not be checked ({errno.errorcode[code]}: "
        f"{os.strerror(code)}, at {parent}), a limit or failure of this process or system "
        "at the time, not a fault of the directory"
    )
    assert (_exit_of(raised.value), errno_of(raised.value)) == (1, code)  # restarted


def test_the_ancestors_oserror_is_raised_only_when_asked(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Callers that ask no more (the engine build's staging checks) still refuse it."""
    parent = _parent(directory)
    _fail_stat_of(monkeypatch, parent, errno.EIO)
    cannot = f"has an ancestor {parent} that cannot be examined (Input/output error)"
    assert unsafe_ancestor_reason(directory) == cannot
    assert unsafe_owned_dir_reason(directory) == cannot
    with pytest.raises(OSError) as raised:
        unsafe_ancestor_reason(directory, raise_unchecked=True)
    assert (raised.value.errno, raised.value.filename) == (errno.EIO, str(parent))


@pytest.mark.parametrize("code", [errno.EACCES, errno.ENOENT])
def test_an_ancestor_refused_for_a_reason_of_its_own_stays_unsafe(
    directory: Path, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Passes before and after: no search permission, or removed meanwhile, is about
    the path, which a restart would meet again."""
    parent = _parent(directory)
    _fail_stat_of(monkeypatch, parent, code)
    with pytest.raises(UnsafeDirectoryError) as raised:
        ensure_owned_dir(directory, what="daemon.state_dir")
    assert type(raised.value) is UnsafeDirectoryError
    assert f"has an ancestor {parent} that cannot be examined ({os.strerror(code)})" in str(
        raised.value
    )
    assert _exit_of(raised.value) == 2


def test_a_clients_dir_whose_ancestor_could_not_be_examined_is_not_a_config_error(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_clients`` sorts what the check raises (DESIGN.md entry 323): before, the
    ancestor's ``EIO`` was a reason, so a ``CurveKeyError`` and ``inferd run`` exit 2."""
    _fail_stat_of(monkeypatch, _parent(directory), errno.EIO)
    with pytest.raises(OSError) as raised:
        load_clients(directory)
    assert not isinstance(raised.value, ConfigError)
    assert raised.value.errno == errno.EIO
    assert str(raised.value).startswith(
        f"security.curve_clients_dir {directory} could not be checked (EIO: "
    )
    assert (_exit_of(raised.value), errno_of(raised.value)) == (1, errno.EIO)
