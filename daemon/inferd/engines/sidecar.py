"""``<engine>.sha256`` sidecars, in ``sha256sum`` format.

One line: the lowercase hex SHA-256 of the engine, two spaces, the engine's
file name (``sha256sum -c demo_....engine.sha256`` works in its directory).
Digests are computed by ``inferd.digest.sha256_file``, which streams the file
in 1 MiB chunks: a 2 GiB engine needs about 1 MiB of memory to hash.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

from inferd.digest import sha256_file
from inferd.durable import atomic_write_text
from inferd.errors import (
    EngineHashMismatchError,
    EngineSidecarMissingError,
    UncheckedEngineError,
)
from inferd.owned_files import ABOUT_THE_DIRECTORY, open_own_file

SIDECAR_SUFFIX = ".sha256"
#: A sidecar is one short line; a larger file is malformed, not read whole.
SIDECAR_MAX_BYTES = 4096
#: A failed ``open``, ``stat`` or read of an engine or its sidecar that says something
#: about the file, the same at the next look: ``ABOUT_THE_DIRECTORY``'s rule (a symlink,
#: nothing there, no permission, ``EPERM``: ``open_own_file``'s "others could rewrite
#: it"), and what ``open_regular_file`` and ``open(2)`` say of what is not a regular
#: file (``EINVAL``, ``EISDIR``, ``ENXIO`` a socket, ``ENODEV`` a device without its
#: driver), and ``EIO``: a media error in the file's blocks, met again at every read
#: until the file is written anew, which a rebuild does (to fresh blocks): a verdict,
#: the gate refuses it.  Any other errno (``EMFILE``, ``ENFILE``, ``ENOMEM``,
#: ``ESTALE``...) is this process's or system's state at the time:
#: ``UncheckedEngineError``, no verdict (the directory's rule, DESIGN.md 329).
ABOUT_THE_FILE = ABOUT_THE_DIRECTORY | {
    errno.EINVAL,
    errno.EISDIR,
    errno.ENXIO,
    errno.ENODEV,
    errno.EIO,
}

_LINE = re.compile(r"([0-9a-fA-F]{64})(?:[ \t]+\*?(\S.*))?")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def sidecar_path(engine: Path) -> Path:
    return engine.with_name(engine.name + SIDECAR_SUFFIX)


def format_sidecar(digest: str, engine_name: str) -> str:
    if not _HEX64.fullmatch(digest):
        raise ValueError(f"digest must be 64 lowercase hex digits, got {digest!r}")
    if "/" in engine_name or "\n" in engine_name or not engine_name.strip():
        raise ValueError(f"sidecar names a file, not a path: {engine_name!r}")
    return f"{digest}  {engine_name}\n"


def parse_sidecar(text: str, *, engine_name: str, source: str = "sidecar") -> str:
    """The digest a sidecar holds, lowercased.  ``EngineHashMismatchError(stage="sidecar")``
    when it is malformed or names another file."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        raise EngineHashMismatchError(
            f"{source} is malformed: expected one '<sha256>  <file name>' line, "
            f"found {len(lines)} non-empty line(s)",
            stage="sidecar",
        )
    match = _LINE.fullmatch(lines[0].strip())
    if match is None:
        raise EngineHashMismatchError(
            f"{source} is malformed: {lines[0].strip()[:100]!r} is not "
            "'<64 hex digits>  <file name>'",
            stage="sidecar",
        )
    named = match.group(2)
    if named is not None and named.strip() != engine_name:
        raise EngineHashMismatchError(
            f"{source} is for {named.strip()!r}, not {engine_name!r}", stage="sidecar"
        )
    return match.group(1).lower()


def about_the_file(exc: OSError) -> bool:
    """Whether ``exc`` (an engine's or a sidecar's) is a verdict on the file."""
    return exc.errno is None or exc.errno in ABOUT_THE_FILE


def unchecked_engine(
    what: str, done: str, exc: OSError, *, fault: str = "the file"
) -> UncheckedEngineError:
    """``exc``, not about the file, as what it is: ``what`` (an engine, its sidecar)
    could not be ``done``, naming the errno (``owned_files._unchecked``'s words)."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, f"errno {code}")
    return UncheckedEngineError(
        f"{what} could not be {done} ({name}: {exc.strerror}), a limit or failure of this "
        f"process or system at the time, not a fault of {fault}: the engine is not used "
        "this time, and nothing is moved aside or rebuilt for it",
        errno_code=code,
    )


def read_sidecar(engine: Path, *, follow: bool = False, raise_unchecked: bool = False) -> str:
    """The digest in ``engine``'s sidecar.  ``EngineSidecarMissingError`` when there is
    none (or not a regular file); ``EngineHashMismatchError(stage="sidecar")`` when it is
    unreadable or malformed (a symlink too, or a file others could rewrite, unless
    ``follow``: for a staged engine, an operator's file).  ``raise_unchecked`` (the
    gate): a read that failed for a reason not about the file (``ABOUT_THE_FILE``)
    raises ``UncheckedEngineError`` instead of that refusal."""
    path = sidecar_path(engine)
    try:
        with open_own_file(path, follow=follow)[0] as handle:
            data = handle.read(SIDECAR_MAX_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        raise EngineSidecarMissingError(
            f"engine {engine.name!r} has no digest sidecar {path.name!r}: the gate trusts only "
            "engines with one"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # a directory, a FIFO (refused, never waited on)
            raise EngineSidecarMissingError(
                f"digest sidecar {path} is not a regular file"
            ) from None
        if raise_unchecked and not about_the_file(exc):
            raise unchecked_engine(f"digest sidecar {path}", "read", exc) from exc
        raise EngineHashMismatchError(
            f"digest sidecar {path} cannot be read: {exc}", stage="sidecar"
        ) from exc
    if len(data) > SIDECAR_MAX_BYTES:
        raise EngineHashMismatchError(
            f"digest sidecar {path.name!r} is malformed: larger than {SIDECAR_MAX_BYTES} bytes",
            stage="sidecar",
        )
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise EngineHashMismatchError(
            f"digest sidecar {path.name!r} is malformed: not ASCII text", stage="sidecar"
        ) from None
    return parse_sidecar(text, engine_name=engine.name, source=f"digest sidecar {path.name!r}")


def write_sidecar(engine: Path, digest: str | None = None) -> Path:
    """Write ``engine``'s sidecar atomically (computing the digest, streamed, unless
    given) and return its path.  For builders: the gate itself never writes."""
    value = sha256_file(engine) if digest is None else digest.lower()
    path = sidecar_path(engine)
    atomic_write_text(path, format_sidecar(value, engine.name))
    return path
