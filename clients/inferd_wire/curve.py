"""CURVE keys on disk, shared by the daemon (``inferd keys``, its tcp:// sockets) and
clients.

Key files use ZeroMQ's certificate format (ZPL, as pyzmq's
``zmq.auth.create_certificates`` and czmq's ``zcert`` write them): a public
certificate ``NAME.key`` holds ``public-key``, a secret one ``NAME.key_secret``
holds both keys, each as 40 Z85 characters.  ``zmq.auth.load_certificate`` reads
what ``format_certificate`` writes, and this module reads theirs.  Files are read
from bytes the caller opened: the daemon opens its own without following symlinks.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

#: Z85 encodes a 32-byte CURVE key in 40 characters.
KEY_LENGTH = 40
_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_LINE = re.compile(r'^\s*(public|secret)-key\s*=\s*"([^"]*)"\s*$')


class CurveKeyError(ValueError):
    """A key or key file that is not what it should be; the message names it."""


@dataclass(frozen=True)
class CurveKeys:
    public: str
    secret: str | None = None


def check_key(text: str, what: str) -> str:
    if not _Z85.match(text):
        raise CurveKeyError(f"{what}: not a CURVE key (40 Z85 characters), got {text[:48]!r}")
    return text


def parse_certificate(data: bytes, source: str) -> CurveKeys:
    """The keys of a certificate file's bytes; ``CurveKeyError`` naming ``source``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CurveKeyError(f"{source}: not a CURVE certificate (not UTF-8 text)") from None
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            found[match.group(1)] = check_key(match.group(2), f"{source}: {match.group(1)}-key")
    if "public" not in found:
        raise CurveKeyError(f"{source}: no public-key line; not a CURVE certificate")
    keys = CurveKeys(found["public"], found.get("secret"))
    if keys.secret is not None and zmq.curve_public(keys.secret.encode()).decode() != keys.public:
        raise CurveKeyError(f"{source}: its secret-key does not belong to its public-key")
    return keys


def format_certificate(keys: CurveKeys, name: str) -> bytes:
    """A certificate in ZeroMQ's format: public only, or with the secret key."""
    kind = "Public" if keys.secret is None else "**Secret**"
    lines = [
        f"#   ZeroMQ CURVE {kind} Certificate, written by inferd keys",
        "#   Exchange public certificates securely; never share a secret one.",
        "",
        "metadata",
        f'    name = "{name}"',
        "curve",
        f'    public-key = "{keys.public}"',
    ]
    if keys.secret is not None:
        lines.append(f'    secret-key = "{keys.secret}"')
    return ("\n".join(lines) + "\n").encode()


def new_keys() -> CurveKeys:
    public, secret = zmq.curve_keypair()
    return CurveKeys(public.decode("ascii"), secret.decode("ascii"))


@dataclass(frozen=True)
class ClientCurve:
    """What a client needs for a CURVE tcp:// endpoint: the daemon's public key
    (``inferd keys show``) and its own keypair (the secret certificate ``inferd keys
    client NAME`` wrote, or one whose public half the daemon allow-listed)."""

    server_public_key: str
    public_key: str
    secret_key: str

    @classmethod
    def from_files(cls, server_key: str | Path, certificate: Path) -> ClientCurve:
        """``server_key``: a file holding the daemon's public key (a public
        certificate, or the bare key), or else the key itself; ``certificate``: this
        client's secret certificate, which only its owner may read."""
        server = str(server_key)
        # The file first: a path may well be 40 characters that Z85 allows.
        if Path(server).is_file():
            data = Path(server).read_bytes()
            bare = data.decode("utf-8", "replace").strip()
            server = bare if _Z85.match(bare) else parse_certificate(data, server).public
        elif not _Z85.match(server):
            raise CurveKeyError(
                f"the server key {server[:48]!r} is neither a file nor a CURVE key "
                "(40 Z85 characters)"
            )
        mode = os.stat(certificate).st_mode
        if stat.S_IMODE(mode) & 0o077:
            raise CurveKeyError(
                f"{certificate}: a secret key others may read (mode {stat.S_IMODE(mode):04o}); "
                f"chmod 600 {certificate}"
            )
        keys = parse_certificate(Path(certificate).read_bytes(), str(certificate))
        if keys.secret is None:
            raise CurveKeyError(f"{certificate}: holds no secret-key (a public certificate?)")
        return cls(check_key(server, "the server key"), keys.public, keys.secret)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE client of the daemon (before it connects)."""
        sock.curve_serverkey = self.server_public_key.encode()
        sock.curve_publickey = self.public_key.encode()
        sock.curve_secretkey = self.secret_key.encode()
