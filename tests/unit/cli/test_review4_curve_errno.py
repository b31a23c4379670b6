"""A CURVE key file or the clients directory that could not be read for a reason
not about it (``EIO``, ``EMFILE``) is no config error: ``inferd run`` exits 1 (restarted
by ``Restart=on-failure``) with ``ERRNO=``, and says the file is not at fault, as
``ensure_owned_dir`` does for a directory (DESIGN.md 309).  What is about the file
(missing, a symlink, not a regular file, not readable by this user, a name too long)
stays a config error, exit 2 (review R1, F1)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from inferd import config
from inferd.bus import curve_keys
from inferd.bus.curve_keys import load_curve
from inferd.cli.main import main
from inferd.errors import ConfigError
from inferd.owned_files import open_regular_file
from tests.conftest import TAKE_EVERY_DESCRIPTOR
from tests.unit.cli.conftest import python_c, sent
from tests.unit.cli.test_review3_cli import _write_public_certificate, curve_config


def _keys(base: Path) -> Path:
    """A config whose keys ``inferd keys init`` wrote, and one client key."""
    path = curve_config(base)
    assert main(["keys", "init", "--config", str(path)]) == 0
    _write_public_certificate(base / "s" / "keys" / "clients" / "ground.key")
    load_curve(config.load(path).security)  # they load
    return path


#: ``inferd run`` with the secret key's open failing with the errno in argv[1].
_RUN_WITH_OPEN_FAILING = """
import errno, os, sys
from inferd.bus import curve_keys
from inferd.cli.main import main
code = getattr(errno, sys.argv[1])
def failing(path, *args, **kwargs):
    raise OSError(code, os.strerror(code), str(path))
curve_keys.open_regular_file = failing
sys.exit(main(["run", "--config", sys.argv[2], "--log-format", "console"]))
"""


@pytest.mark.parametrize("name", ["EIO", "ENOMEM", "ENFILE"])
def test_inferd_run_exits_1_with_errno_when_a_key_cannot_be_opened_for_a_reason_not_its_own(
    base: Path, name: str
) -> None:
    """Before: "invalid config ...: cannot be opened: Input/output error", exit 2
    (``RestartPreventExitStatus=2``: never retried), no ``ERRNO=``."""
    path = _keys(base)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(base / "notify.sock"))
    notify.setblocking(False)
    try:
        result = python_c(
            _RUN_WITH_OPEN_FAILING,
            name,
            str(path),
            env={**os.environ, "NOTIFY_SOCKET": str(base / "notify.sock")},
        )
        lines = sent(notify)
    finally:
        notify.close()
    said = result.stdout + result.stderr
    assert result.returncode == 1, said[-2000:]
    secret = base / "s" / "keys" / "server.key_secret"
    line = (
        f"inferd: cannot start: security.curve_secret_key {secret} could not be opened "
        f"({name}: {os.strerror(getattr(errno, name))}), a limit or failure of this process "
        "or system at the time, not a fault of the file\n"
    )
    assert line in result.stderr, said[-2000:]
    assert "invalid config" not in said and "Traceback" not in said
    assert f"ERRNO={getattr(errno, name)}" in lines, lines


#: ``load_curve`` with every free descriptor taken under a soft limit of 64; prints
#: what it raised (class, errno, whether a ConfigError, message), then ``inferd run``'s
#: exit for it, with the descriptors given back.
_AT_THE_LIMIT = (
    """
import sys
from pathlib import Path
from inferd import config
from inferd.bus.curve_keys import load_curve
from inferd.cli.main import _cannot_start
from inferd.errors import ConfigError
from inferd.supervision.notify import Notifier
security = config.load(Path(sys.argv[1])).security
"""
    + TAKE_EVERY_DESCRIPTOR
    + """
try:
    load_curve(security)
except Exception as exc:
    error = exc
else:
    error = None
for fd in taken:
    os.close(fd)
if error is None:
    print("loaded")
else:
    code = _cannot_start(Notifier.from_environment(), sys.argv[1], error)
    print(type(error).__name__, getattr(error, "errno", None), isinstance(error, ConfigError),
          code, error, sep="|")
"""
)


def test_keys_met_at_the_descriptor_limit_are_not_a_config_error(base: Path) -> None:
    path = _keys(base)
    done = python_c(_AT_THE_LIMIT, str(path), check=True)
    kind, code, config_error, exit_code, message = done.stdout.strip().split("|")
    assert (kind, code, config_error, exit_code) == (
        "UncheckedKeyFileError",
        str(errno.EMFILE),
        "False",
        "1",
    ), done.stdout
    assert message.startswith(
        f"security.curve_secret_key {base / 's' / 'keys' / 'server.key_secret'} could not be "
        "opened (EMFILE: "
    ), message


def test_a_clients_dir_that_cannot_be_opened_for_want_of_descriptors_is_not_a_config_error(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``unsafe_owned_dir_reason`` gave "cannot be opened (Too many open files)"
    as the directory's fault, a config error (exit 2)."""
    security = config.load(_keys(base)).security
    clients = security.curve_clients_dir
    real_open = os.open

    def emfile_for_the_clients_dir(
        path: str | Path, flags: int, mode: int = 0o777, *, dir_fd: int | None = None
    ) -> int:
        if os.fspath(path) == os.fspath(clients):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), os.fspath(clients))
        return real_open(path, flags, mode, dir_fd=dir_fd)  # rmtree's too, at teardown

    monkeypatch.setattr(os, "open", emfile_for_the_clients_dir)
    with pytest.raises(OSError) as raised:
        load_curve(security)
    assert not isinstance(raised.value, ConfigError)
    assert raised.value.errno == errno.EMFILE
    assert str(raised.value).startswith(
        f"security.curve_clients_dir {clients} could not be checked (EMFILE: "
    )


def test_a_key_file_that_cannot_be_read_is_not_a_config_error(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``EIO`` from the read after the open: the file named, its errno kept."""
    security = config.load(_keys(base)).security
    real = open_regular_file

    class Failing:
        def __init__(self, handle: object) -> None:
            self.handle = handle

        def __enter__(self) -> Failing:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()  # type: ignore[attr-defined]

        def read(self, size: int) -> bytes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def opened(path: Path, **kwargs: bool) -> tuple[object, os.stat_result]:
        handle, info = real(path, **kwargs)
        return Failing(handle), info

    monkeypatch.setattr(curve_keys, "open_regular_file", opened)
    with pytest.raises(OSError) as raised:
        load_curve(security)
    assert not isinstance(raised.value, ConfigError) and raised.value.errno == errno.EIO
    assert "server.key_secret could not be read (EIO: " in str(raised.value)


def _symlink(secret: Path) -> None:
    target = secret.with_name("elsewhere")
    secret.rename(target)
    secret.symlink_to(target)


def _directory(secret: Path) -> None:
    secret.unlink()
    secret.mkdir()


def _fifo(secret: Path) -> None:
    secret.unlink()
    os.mkfifo(secret, 0o600)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_symlink, "is a symbolic link"),
        (_directory, "is not a regular file"),
        (_fifo, "is not a regular file"),
    ],
)
def test_a_key_file_that_is_not_one_stays_a_config_error(
    base: Path, make: object, says: str
) -> None:
    """What is about the file is the same at the next start: exit 2, as before."""
    security = config.load(_keys(base)).security
    make(security.curve_secret_key)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=says):
        load_curve(security)


@pytest.mark.parametrize("code", [errno.EACCES, errno.ENAMETOOLONG, errno.ENXIO])
def test_an_open_refused_for_the_file_itself_stays_a_config_error(
    base: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """``EACCES`` (the tests run as root: simulated), a name too long, a socket."""
    security = config.load(_keys(base)).security

    def refused(path: Path, **kwargs: bool) -> object:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(curve_keys, "open_regular_file", refused)
    with pytest.raises(ConfigError, match=f"cannot be opened: {os.strerror(code)}"):
        load_curve(security)
