"""``inferd keys``: the CURVE keys of a daemon whose tcp:// endpoints use CURVE
(``security.curve``; docs/SECURITY.md).

- ``init`` writes the daemon's keypair (``security.curve_secret_key``, ``0600``,
  and the public certificate next to it: ``public_certificate``) unless it exists;
  prints the public key.
- ``show`` prints the daemon's public key (what clients need).
- ``client NAME --out DIR`` makes a client keypair: its secret certificate goes to
  ``DIR/NAME.key_secret`` (give it to the client), its public certificate into
  ``security.curve_clients_dir`` (allow-listed as ``key:NAME`` at the next start).
- ``allow NAME KEY|FILE`` allow-lists a public key a client made itself.

Run it as the daemon's user (``sudo -u inferd``): the daemon refuses key files it
does not own.  Keys are read at start: restart the daemon after a change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zmq.utils import z85

from inferd.bus.curve_keys import load_clients, read_owned_file
from inferd.config import Config, SecurityConfig
from inferd.config.security import KEY_NAME
from inferd.durable import atomic_write_bytes
from inferd.errors import ConfigError, UnsafeDirectoryError
from inferd.owned_files import ensure_owned_dir
from inferd_wire.curve import (
    CurveKeyError,
    CurveKeys,
    check_key,
    format_certificate,
    new_keys,
    parse_certificate,
)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
SECRET_MODE = 0o600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="keys_command", required=True)
    init = commands.add_parser("init", help="write the daemon's keypair; print its public key")
    init.add_argument("--force", action="store_true", help="replace an existing keypair")
    commands.add_parser("show", help="print the daemon's public key")
    client = commands.add_parser("client", help="make and allow-list a client keypair")
    client.add_argument("name", help="the client's name (key:NAME in allow-lists)")
    client.add_argument("--out", type=Path, required=True, help="where its secret certificate goes")
    client.add_argument("--force", action="store_true", help="replace a client of that name")
    allow = commands.add_parser("allow", help="allow-list a client's public key")
    allow.add_argument("name")
    allow.add_argument(
        "key",
        help="the client's public key, or its public certificate file (a Z85 key may begin "
        "with '-': put it after '--', as in: keys allow NAME -- KEY)",
    )
    allow.add_argument("--force", action="store_true", help="replace a client of that name")
    for sub in (init, commands.choices["show"], client, allow):
        sub.add_argument("--config", type=Path, help="the daemon's config (default: embedded)")


def run_from_args(args: argparse.Namespace) -> int:
    from inferd import config as config_module

    try:
        config: Config = (
            config_module.load(args.config) if args.config else config_module.embedded_default()
        )
        security = config.security
        if args.keys_command == "init":
            return _init(security, args.force)
        if args.keys_command == "show":
            print(_server_keys(security).public)
            return EXIT_OK
        if not KEY_NAME.match(args.name):
            raise CurveKeyError(f"client name {args.name!r}: use letters, digits, '_', '.', '-'")
        if args.keys_command == "client":
            return _client(security, args.name, args.out, args.force)
        return _allow(security, args.name, args.key, args.force)
    except ConfigError as exc:
        print(f"inferd: invalid config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CurveKeyError, UnsafeDirectoryError, OSError) as exc:
        print(f"inferd: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def public_certificate(secret: Path) -> Path:
    """``server.key_secret`` -> ``server.key``, ``server`` -> ``server.key``; a secret
    already named ``*.key`` -> ``server.key.pub``, never the secret's own path (which
    the public certificate would overwrite)."""
    public = secret.with_name(secret.name.removesuffix("_secret").removesuffix(".key") + ".key")
    return secret.with_name(secret.name + ".pub") if public == secret else public


def _server_keys(security: SecurityConfig) -> CurveKeys:
    path = security.curve_secret_key
    return parse_certificate(
        read_owned_file(path, "security.curve_secret_key", secret=True), str(path)
    )


def _init(security: SecurityConfig, force: bool) -> int:
    secret = security.curve_secret_key
    if secret.exists() and not force:
        print(f"inferd: {secret} exists; kept it (--force replaces it)", file=sys.stderr)
        print(_server_keys(security).public)
        return EXIT_OK
    ensure_owned_dir(secret.parent, what="the directory of security.curve_secret_key")
    keys = new_keys()
    atomic_write_bytes(secret, format_certificate(keys, "inferd"), mode=SECRET_MODE)
    public = format_certificate(CurveKeys(keys.public), "inferd")
    atomic_write_bytes(public_certificate(secret), public)
    print(f"inferd: wrote {secret} (0600) and {public_certificate(secret)}", file=sys.stderr)
    print(keys.public)
    return EXIT_OK


def _client(security: SecurityConfig, name: str, out: Path, force: bool) -> int:
    if not out.is_dir():
        raise CurveKeyError(f"--out {out} is not a directory")
    secret = out / f"{name}.key_secret"
    if secret.exists() and not force:
        raise CurveKeyError(f"{secret} exists (--force replaces it)")
    # Refused before the secret is written: a secret matching no allow-listed key
    # would be handed to a client the daemon then turns away.
    _allow_list_path(security, name, force)
    keys = new_keys()
    atomic_write_bytes(secret, format_certificate(keys, name), mode=SECRET_MODE)
    allowed = _allow_listed(security, name, keys.public, force)
    print(f"inferd: wrote {secret} (0600, for the client) and {allowed}", file=sys.stderr)
    print(keys.public)
    return EXIT_OK


def _allow(security: SecurityConfig, name: str, key: str, force: bool) -> int:
    if Path(key).is_file():
        data = Path(key).read_bytes()
        public = parse_certificate(data, key).public
    else:
        public = check_key(key, "the client's public key")
    print(_allow_listed(security, name, public, force))
    return EXIT_OK


def _allow_listed(security: SecurityConfig, name: str, public: str, force: bool) -> Path:
    path = _allow_list_path(security, name, force)
    # The daemon refuses to start with one key under two names ("is the same key as").
    other = load_clients(path.parent).get(z85.decode(public.encode()))
    if other is not None and other != name:
        raise CurveKeyError(
            f"that key is allow-listed already as {other!r} "
            f"({path.parent / other}.key): one key, one name"
        )
    atomic_write_bytes(path, format_certificate(CurveKeys(public), name))
    return path


def _allow_list_path(security: SecurityConfig, name: str, force: bool) -> Path:
    """Where client ``name``'s public certificate goes; ``CurveKeyError`` if a client
    of that name is allow-listed and ``force`` is not given, or if the daemon would
    refuse the keys already there (``load_clients``: it would not start)."""
    directory = ensure_owned_dir(security.curve_clients_dir, what="security.curve_clients_dir")
    load_clients(directory)
    path = directory / f"{name}.key"
    if path.exists() and not force:
        raise CurveKeyError(f"a client named {name!r} exists: {path} (--force replaces it)")
    return path
