"""``inferd check-config FILE``: every mistake at once, the loader's and those of the
files the config names that the daemon opens at start, or the config resolved, as
TOML (``inferd.config.render``).

The files are looked at with ``stat`` alone, never opened (a FIFO there is named,
not waited on), so that the check means the same whoever runs it: an operator who
is not the daemon's user may not read its secret key.  A path whose ``stat`` fails
for another reason than its absence (``EACCES`` in the daemon's ``0750``
directory, ``ENAMETOOLONG``) is said to be one that "cannot be examined", with the
errno's words, never a traceback.  What only the daemon's user can check (a key
file's owner, a certificate's content, one client key under two names) is checked
at start, where it is a config error too (exit 2).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from inferd.bus.curve_keys import NO_SECRET_KEY, SERVER_PUBLIC_SUFFIX, mode_problem
from inferd.config import Config, SecurityConfig
from inferd.config.security import KEY_NAME
from inferd.engines.locate import examined, model_file_problem
from inferd.errors import ConfigError
from inferd_wire.endpoints import unsafe_directory_reason

EXIT_OK = 0
EXIT_USAGE = 2


def check_config(path: Path) -> int:
    from inferd import config
    from inferd.config.render import config_to_toml
    from inferd.supervision.map_count import mappings_needed
    from inferd.supervision.open_files import descriptors_needed

    try:
        loaded = config.load(path)
    except ConfigError as exc:
        print(f"inferd: invalid config {path}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    problems = file_problems(loaded)
    if problems:
        listed = "\n".join(f"  - {line}" for line in problems)
        print(f"inferd: invalid config {path}:\n{listed}", file=sys.stderr)
        return EXIT_USAGE
    # Said, not checked: this process's RLIMIT_NOFILE is not the daemon's (its unit's),
    # so both lines are printed whatever the limits here: "note:", not a warning.
    needed = descriptors_needed(loaded.bus.max_connections, loaded.shm)
    print(
        f"inferd: note: {path} needs {needed} open descriptors: inferd run refuses to start "
        "under a lower limit (the unit's LimitNOFILE=)",
        file=sys.stderr,
    )
    print(
        f"inferd: note: {path} needs {mappings_needed(loaded.shm)} memory mappings beside those "
        "the daemon maps at start (a few hundred): inferd run refuses to start when "
        "vm.max_map_count cannot hold them",
        file=sys.stderr,
    )
    print(config_to_toml(loaded), end="")
    return EXIT_OK


def file_problems(loaded: Config) -> list[str]:
    """Model and staged-engine files that are not regular files (symlinks followed:
    they are the operator's), and with ``security.curve`` the key files the daemon
    would refuse at start."""
    problems = [
        f"models[{model.name!r}].{key}: {file} {problem}"
        for model in loaded.models
        for key, files in (("path", (model.path,)), ("staged_engines", model.staged_engines))
        for file in files
        if (problem := model_file_problem(file)) is not None
    ]
    if loaded.security.curve:
        problems += curve_problems(loaded.security)
    return problems


def curve_problems(security: SecurityConfig) -> list[str]:
    """The secret key and the client keys as the daemon's ``read_owned_file`` and
    ``load_clients`` take them, as far as ``stat`` shows: regular files (a symlink is
    not followed), the secret readable by its owner only, none writable by group or
    others, in a clients directory no one else may write, each named as ``key:NAME``
    names it; and a file for each ``key:NAME`` principal."""
    secret = security.curve_secret_key
    problems: list[str] = []
    problem = key_file_problem(secret, secret=True)
    if problem is not None:
        said = NO_SECRET_KEY if problem == "does not exist" else problem
        problems.append(f"security.curve_secret_key: {secret} {said}")
    clients = security.curve_clients_dir
    reason = unsafe_directory_reason(clients, None)  # the owner: checked at start
    if reason not in (None, "does not exist"):
        problems.append(
            f"security.curve_clients_dir: {clients} {reason}: only the daemon's user may add "
            "client keys"
        )
    elif reason is None:
        problems += _client_key_problems(clients)
    for key, name in security.key_names():  # its mode is said above, with its file's name
        problem = key_file_problem(clients / f"{name}{SERVER_PUBLIC_SUFFIX}", mode=False)
        if problem is not None:
            problems.append(f"{key}: no client key {name!r} ({clients / name}.key {problem})")
    return problems


def _client_key_problems(clients: Path) -> list[str]:
    try:
        names = sorted(os.listdir(clients))
    except OSError as exc:
        return [f"security.curve_clients_dir: {clients} cannot be listed ({exc.strerror})"]
    problems: list[str] = []
    for file in names:
        stem, suffix = os.path.splitext(file)
        if suffix != SERVER_PUBLIC_SUFFIX or file.startswith("."):
            continue  # what load_clients leaves out (a client's *.key_secret)
        if not KEY_NAME.match(stem):
            problems.append(
                f"client key {clients / file}: the name {stem!r} must be letters, digits, "
                "'_', '.', '-'"
            )
        elif (problem := key_file_problem(clients / file)) is not None:
            problems.append(f"client key {clients / file} {problem}")
    return problems


def key_file_problem(path: Path, *, secret: bool = False, mode: bool = True) -> str | None:
    """Why the daemon would refuse the key file at ``path`` as far as ``lstat`` shows
    ("does not exist", "is a symbolic link", its ``mode`` unless told not to look at
    it), or None."""
    info = examined(path, follow=False)
    if isinstance(info, str):
        return info
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link: the daemon opens key files without following one"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    return mode_problem(path, stat.S_IMODE(info.st_mode), secret=secret) if mode else None
