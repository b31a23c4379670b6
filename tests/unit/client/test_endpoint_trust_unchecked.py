"""A socket directory the client could not check is not reported as unsafe.

The trust check (``inferd_wire.endpoints.check_client_endpoint``) opens an ipc://
socket's directory before connecting.  At the descriptor limit that ``open`` fails
``EMFILE``, which says nothing about who may write the directory: the client says
``Unreachable`` naming the errno and the directory, not ``UnsafeEndpoint``'s
"another user could have put their own socket there".  What is about the
directory (a symlink, a directory this user may not enter, one others may write)
stays ``UnsafeEndpoint``, a missing one is still left to the connect, and the
daemon's own check (no ``raise_unchecked``) still refuses what it could not check.
``os.open`` and ``os.fstat`` are failed for that directory alone, in this process."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from inferd_client.endpoint_trust import trusted_endpoint
from inferd_client.errors import ClientError, Unreachable, UnsafeEndpoint
from inferd_wire.endpoints import (
    UnsafeEndpointError,
    check_client_endpoint,
    unsafe_directory_reason,
)
from tests.unit.client.test_endpoint_trust import CONNECTORS


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    return directory


def fail_open_of(monkeypatch: pytest.MonkeyPatch, directory: Path, code: int) -> list[str]:
    """``os.open`` of ``directory`` fails with ``code``; any other open is the real
    one.  Returns the paths it failed, so a test sees the check was made."""
    real_open = os.open
    failed: list[str] = []

    def open_failing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(path) == str(directory):
            failed.append(str(path))
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_failing)
    return failed


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_client_at_its_descriptor_limit_is_told_so(
    private_dir: Path, connector: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = f"ipc://{private_dir}/infer.sock"
    failed = fail_open_of(monkeypatch, private_dir, errno.EMFILE)
    with pytest.raises(ClientError) as raised:
        CONNECTORS[connector](endpoint)
    assert failed == [str(private_dir)]
    assert type(raised.value) is Unreachable
    message = str(raised.value)
    assert message == (
        f"not connecting to {endpoint}: its directory {private_dir} could not be checked "
        "(EMFILE: Too many open files), a limit or failure of this process or system, not "
        "a sign of another user's socket"
    )
    assert "another user could have" not in message


@pytest.mark.parametrize("code", [errno.ENFILE, errno.ENOMEM, errno.EINTR, errno.EIO])
def test_other_failures_not_about_the_directory_are_unreachable_too(
    private_dir: Path, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_open_of(monkeypatch, private_dir, code)
    with pytest.raises(Unreachable, match=f"could not be checked \\({errno.errorcode[code]}: "):
        trusted_endpoint(f"ipc://{private_dir}/infer.sock")


def test_a_directory_that_cannot_be_examined_after_its_open_is_unreachable(
    private_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``fstat`` of the opened directory failing (``EIO``) was a bare ``OSError``."""
    real_fstat = os.fstat
    opened = os.stat(private_dir)

    def fstat_failing(fd: int) -> os.stat_result:
        info = real_fstat(fd)
        if (info.st_dev, info.st_ino) == (opened.st_dev, opened.st_ino):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return info

    monkeypatch.setattr(os, "fstat", fstat_failing)
    with pytest.raises(Unreachable, match=r"could not be checked \(EIO: Input/output error\)"):
        trusted_endpoint(f"ipc://{private_dir}/infer.sock")


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_a_directory_this_user_may_not_enter_is_still_unsafe(
    private_dir: Path, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_open_of(monkeypatch, private_dir, code)
    with pytest.raises(UnsafeEndpoint, match=f"cannot be opened \\({os.strerror(code)}\\)"):
        trusted_endpoint(f"ipc://{private_dir}/infer.sock")


def test_a_symlink_and_a_writable_directory_are_still_unsafe(private_dir: Path) -> None:
    link = private_dir.parent / "link"
    link.symlink_to(private_dir)
    with pytest.raises(UnsafeEndpoint, match="is a symbolic link, so another user"):
        trusted_endpoint(f"ipc://{link}/infer.sock")
    os.chmod(private_dir, 0o777)
    with pytest.raises(UnsafeEndpointError, match="is writable by its group and others"):
        check_client_endpoint(f"ipc://{private_dir}/infer.sock")


def test_a_missing_directory_is_still_left_to_the_connect(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/absent/infer.sock"
    assert trusted_endpoint(endpoint) == endpoint


def test_the_daemons_check_still_refuses_what_it_could_not_check(
    private_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``owned_files.ensure_owned_dir`` and its neighbours read a reason, never an
    exception, from the open: unchanged."""
    fail_open_of(monkeypatch, private_dir, errno.EMFILE)
    reason = unsafe_directory_reason(private_dir, os.geteuid())
    assert reason == "cannot be opened (Too many open files)"
