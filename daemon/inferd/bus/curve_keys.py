"""The daemon's CURVE keys, read at start (``security.curve``; ``inferd keys`` writes them).

The secret key is refused unless it is a regular file of the daemon's own user
that nobody else may read (``0600``), opened without following a symlink.  The
client keys are the public certificates ``NAME.key`` in
``security.curve_clients_dir`` (a directory of the daemon's own that others
cannot write), each a file of the daemon's own that others cannot write either:
each allow-lists one client, named NAME in the FDR and the logs.
Any problem stops the daemon at start, naming the file, as a config error
(``CurveKeyConfigError``: exit 2, not restarted, as the files would be the same);
nothing falls back to accepting everyone.  A file or directory that could not be
read for a reason not about it (``EMFILE``, ``EIO``: this process's or the system's
state at the time) stops it as an ``OSError`` naming the errno instead: exit 1,
restarted, with ``ERRNO=`` (the rule ``ensure_owned_dir`` applies, DESIGN.md 309).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from zmq.utils import z85

from inferd.bus.zap import ServerKeys
from inferd.config import SecurityConfig
from inferd.config.security import KEY_NAME
from inferd.errors import ConfigError
from inferd.owned_files import ABOUT_THE_DIRECTORY, open_regular_file, unsafe_owned_dir_reason
from inferd_wire.curve import CurveKeyError, parse_certificate

SERVER_PUBLIC_SUFFIX = ".key"
#: A public certificate is small; anything larger is not one.
_MAX_CERT_BYTES = 64 * 1024
#: What a missing secret key is missing (``inferd check-config`` says it too).
NO_SECRET_KEY = (
    "does not exist: run `inferd keys init` (with the daemon's --config) as the daemon's user"
)
#: A failed open that is about the file or directory (``ensure_owned_dir``'s rule),
#: or what ``open_regular_file`` and ``open(2)`` say of what is not a regular file
#: (``EINVAL`` its own "is not a regular file", ``ENXIO`` a socket, ``ENODEV`` a
#: device without its driver): the same at the next start, so a config error.
_ABOUT_THE_FILE = ABOUT_THE_DIRECTORY | {errno.EINVAL, errno.ENXIO, errno.ENODEV}


class CurveKeyConfigError(ConfigError, CurveKeyError):
    """A CURVE key file the daemon refuses at start: a config error, as a ``key:NAME``
    without its file is (``inferd run`` exits 2 and says "invalid config"; a restart
    would meet the same files), and still a ``CurveKeyError`` for ``inferd keys``."""


class UncheckedKeyFileError(OSError):
    """A key file or the clients directory that could not be read for a reason not
    about it (``EMFILE``, ``EIO``): an ``OSError``, so ``inferd run`` exits 1 (restarted)
    with ``ERRNO=``; its message names the file and the errno once."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@dataclass(frozen=True)
class CurveSetup:
    server: ServerKeys
    #: Raw 32-byte public key -> client name.
    clients: dict[bytes, str]


def read_owned_file(path: Path, what: str, *, secret: bool) -> bytes:
    """A small file of the daemon's own, opened without following a symlink; a
    ``secret`` one must be readable by its owner only.  Opened as a regular file
    (``open_regular_file``): a FIFO there is refused, never waited on at start."""
    try:
        handle, info = open_regular_file(path)
    except FileNotFoundError:
        raise CurveKeyError(f"{what} {path} {NO_SECRET_KEY}") from None
    except OSError as exc:
        if not _about_the_file(exc):
            raise _unchecked(what, path, "opened", exc) from None
        raise CurveKeyError(f"{what} {path} cannot be opened: {exc.strerror}") from None
    with handle:
        if info.st_uid != os.geteuid():
            raise CurveKeyError(
                f"{what} {path} is owned by uid {info.st_uid}, not by the daemon's uid "
                f"{os.geteuid()}"
            )
        problem = mode_problem(path, stat.S_IMODE(info.st_mode), secret=secret)
        if problem is not None:
            raise CurveKeyError(f"{what} {path} {problem}")
        try:
            data = handle.read(_MAX_CERT_BYTES + 1)
        except OSError as exc:  # a regular file's read: EIO, ENOMEM, never its config
            raise _unchecked(what, path, "read", exc) from None
    if len(data) > _MAX_CERT_BYTES:
        raise CurveKeyError(f"{what} {path} is larger than a certificate")
    return data


def _about_the_file(exc: OSError) -> bool:
    return exc.errno is None or exc.errno in _ABOUT_THE_FILE


def _unchecked(what: str, path: Path, done: str, exc: OSError) -> UncheckedKeyFileError:
    """``exc`` with its errno kept (``ERRNO=``), saying which key file or directory and
    that nothing is wrong with it (``owned_files._unchecked``'s words for a directory)."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, f"errno {code}")
    return UncheckedKeyFileError(
        code,
        f"{what} {path} could not be {done} ({name}: {exc.strerror}), a limit or failure "
        "of this process or system at the time, not a fault of the file",
    )


def mode_problem(path: Path, mode: int, *, secret: bool) -> str | None:
    """Why a key file of ``mode`` is refused (what follows its name), or None: a
    ``secret`` one that its group or others may read, any that they may write."""
    if secret and mode & 0o077:
        return (
            f"has mode {mode:04o}: others may read the daemon's secret key; "
            f"chmod 600 {path} (and replace the key: inferd keys init --force)"
        )
    # Whoever may write a key file may put their own key in it (an allow-listed
    # client's, with its operator rights).
    writable = [who for who, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit]
    if writable:
        return (
            f"is writable by {' and '.join(writable)} (mode {mode:04o}): "
            f"they could replace the key with their own; chmod go-w {path}"
        )
    return None


def load_curve(security: SecurityConfig) -> CurveSetup:
    """The server keypair and the allow-listed client keys; ``ConfigError`` otherwise:
    ``CurveKeyConfigError`` for a key file refused, or a ``key:NAME`` principal
    without its key file.  ``UncheckedKeyFileError`` (an ``OSError``, not a config
    error) for one that could not be read for a reason not about it."""
    try:
        return _load_curve(security)
    except CurveKeyError as exc:
        raise CurveKeyConfigError(str(exc)) from None


def _load_curve(security: SecurityConfig) -> CurveSetup:
    path = security.curve_secret_key
    keys = parse_certificate(
        read_owned_file(path, "security.curve_secret_key", secret=True), str(path)
    )
    if keys.secret is None:
        raise CurveKeyError(f"security.curve_secret_key {path} holds no secret-key")
    clients = load_clients(security.curve_clients_dir)
    names = set(clients.values())
    for key, name in security.key_names():
        if name not in names:
            raise ConfigError(
                f"{key}: no client key {name!r} ({security.curve_clients_dir / name}.key); "
                f"add it with: inferd keys client {name}, or inferd keys allow {name} KEY"
            )
    return CurveSetup(ServerKeys(keys.public, keys.secret), clients)


def load_clients(directory: Path) -> dict[bytes, str]:
    """``NAME.key`` public certificates of ``directory``; none when it does not exist."""
    # A directory above it that another user may write could swap in their keys.
    try:
        reason = unsafe_owned_dir_reason(directory, raise_unchecked=True)
    except OSError as exc:  # the open's EMFILE..., the fstat's EIO...
        if not _about_the_file(exc):
            raise _unchecked("security.curve_clients_dir", directory, "checked", exc) from None
        reason = f"cannot be opened ({exc.strerror})"  # ENAMETOOLONG, as without raise_unchecked
    if reason == "does not exist":
        return {}
    if reason is not None:
        raise CurveKeyError(
            f"security.curve_clients_dir {directory} {reason}: only the daemon's user may "
            "add client keys"
        )
    clients: dict[bytes, str] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix != SERVER_PUBLIC_SUFFIX or path.name.startswith("."):
            continue
        name = path.stem
        if not KEY_NAME.match(name):
            raise CurveKeyError(
                f"client key {path}: the name {name!r} must be letters, digits, '_', '.', '-'"
            )
        public = parse_certificate(
            read_owned_file(path, "client key", secret=False), str(path)
        ).public
        raw = z85.decode(public.encode())
        if raw in clients:
            raise CurveKeyError(f"client key {path} is the same key as {clients[raw]!r}")
        clients[raw] = name
    return clients
