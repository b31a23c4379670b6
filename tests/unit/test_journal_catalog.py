"""``systemd/inferd.catalog``: the journald message catalog has one entry for every
MESSAGE_ID inferd logs and none for an event it does not, every entry names its event
in the comment before it, and journalctl itself accepts the file.

The events are found in the source: every structlog call (``log.info("name", ...)``,
``self._log.warning(...)``, ``getattr(log, level)(...)``) under ``daemon/inferd``.
An event name given by a constant is resolved in its module; the few computed names
are listed in ``COMPUTED`` by the function that logs them, so a new computed name
fails here until it is listed.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
from pathlib import Path

from inferd.supervision.journal_fields import message_id
from inferd.supervision.journal_writer import DROPPED_EVENT
from tests.conftest import REPO

PACKAGE = REPO / "daemon" / "inferd"
CATALOG = REPO / "systemd" / "inferd.catalog"
_LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "warn", "msg", "fatal"}
_LOGGER = re.compile(r"(^|\.)_?log$|get_logger\(")


def _raised_codes(tree: ast.Module, function: str, position: int = 1) -> set[str]:
    """The string constants of the argument at ``position`` (the code, second, by
    default) of calls of ``function``."""
    codes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(function):
            for argument in ast.walk(node.args[position]):
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    codes.add(argument.value)
    return codes


#: (module, the function whose log call computes the event name) -> how to find the names.
COMPUTED = {
    # FallbackRebuilder._raise logs the alert code passed to it as the event name.
    ("serving/rebuild.py", "_raise"): lambda tree: _raised_codes(tree, "self._raise"),
    # EngineWorker._internal logs the event name passed to it (its fourth argument).
    ("serving/engine_worker.py", "_internal"): lambda tree: _raised_codes(
        tree, "self._internal", 3
    ),
}


def _enclosing_function(tree: ast.Module, call: ast.Call) -> str:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and call in ast.walk(node):
            inner = [
                n
                for n in ast.walk(node)
                if n is not node and isinstance(n, ast.FunctionDef) and call in ast.walk(n)
            ]
            if not inner:
                return node.name
    return "<module>"


def _log_calls(tree: ast.Module) -> list[ast.Call]:
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        function = node.func
        if isinstance(function, ast.Attribute) and function.attr in _LEVELS:
            receiver = function.value
        elif (
            isinstance(function, ast.Call)
            and isinstance(function.func, ast.Name)
            and function.func.id == "getattr"
        ):
            receiver = function.args[0]
        else:
            continue
        if _LOGGER.search(ast.unparse(receiver)):
            calls.append(node)
    return calls


def logged_events() -> dict[str, str]:
    """INFERD_EVENT -> where it is logged first."""
    events: dict[str, str] = {}
    unresolved = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for call in _log_calls(tree):
            where = f"daemon/inferd/{relative}:{call.lineno}"
            argument = call.args[0]
            names: set[str]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                names = {argument.value}
            elif (relative, _enclosing_function(tree, call)) in COMPUTED:
                names = COMPUTED[(relative, _enclosing_function(tree, call))](tree)
                assert names, f"{where}: found no names for a COMPUTED entry"
            elif isinstance(argument, ast.Name | ast.Attribute):
                module = importlib.import_module(
                    "inferd." + relative.removesuffix(".py").replace("/", ".")
                )
                names = {str(eval(ast.unparse(argument), vars(module)))}
            else:
                unresolved.append(f"{where}: {ast.unparse(argument)}")
                continue
            for name in names:
                events.setdefault(name, where)
    assert unresolved == [], (
        f"event names this test cannot resolve (list them in COMPUTED): {unresolved}"
    )
    # The journal writer reports its own drops straight to journald (no log call:
    # the structlog chain is what could not keep up).
    events.setdefault(DROPPED_EVENT, "daemon/inferd/supervision/journal_writer.py")
    return events


def catalog_entries() -> dict[str, dict[str, str]]:
    """MESSAGE_ID -> the entry's headers and the event its comment names."""
    entries: dict[str, dict[str, str]] = {}
    comment: str | None = None
    current: dict[str, str] | None = None
    in_headers = False
    for line in CATALOG.read_text().splitlines():
        if line.startswith("# "):
            comment = line[2:].strip()
        elif line.startswith("-- "):
            identifier = line[3:].strip()
            assert re.fullmatch(r"[0-9a-f]{32}", identifier), line
            assert identifier not in entries, f"duplicate catalog entry {identifier}"
            current = entries[identifier] = {"event": comment or ""}
            comment, in_headers = None, True
        elif in_headers and current is not None:
            if not line:
                in_headers = False
            else:
                key, separator, value = line.partition(": ")
                assert separator, f"bad catalog header line {line!r}"
                current[key] = value
    return entries


def test_every_logged_event_has_a_catalog_entry_and_every_entry_an_event() -> None:
    events = logged_events()
    assert {"daemon_ready", "watchdog_pings_withheld", "fallback_to_onnx_trt_ep"} <= set(events)
    expected = {message_id(event): event for event in events}
    entries = catalog_entries()
    missing = {
        event: f"-- {identifier}  (logged at {events[event]})"
        for identifier, event in expected.items()
        if identifier not in entries
    }
    assert missing == {}, "events without a catalog entry in systemd/inferd.catalog"
    extra = {identifier: entry["event"] for identifier, entry in entries.items()}
    extra = {i: e for i, e in extra.items() if i not in expected}
    assert extra == {}, "catalog entries for events the code does not log"
    for identifier, entry in entries.items():
        assert entry["event"] == expected[identifier], (
            f"the comment before -- {identifier} names {entry['event']!r}, "
            f"but the id is {expected[identifier]!r}'s"
        )
        assert entry.get("Subject") and entry.get("Defined-By") == "inferd", entry


def test_the_scan_finds_a_new_event(tmp_path: Path) -> None:
    """The scanner can fail: a log call with a new name is an event without an entry."""
    tree = ast.parse('log = get()\ndef f():\n    log.warning("brand_new_event", model="m")\n')
    (call,) = _log_calls(tree)
    assert isinstance(call.args[0], ast.Constant) and call.args[0].value == "brand_new_event"
    assert message_id("brand_new_event") not in catalog_entries()


def test_journalctl_accepts_the_catalog(tmp_path: Path) -> None:
    """``journalctl --update-catalog`` under a private root (no root rights needed)
    builds its database from the file and lists every entry."""
    journalctl = shutil.which("journalctl")
    assert journalctl, "journalctl is missing: install the 'systemd' package (.ci/run does)"
    catalog_dir = tmp_path / "usr" / "lib" / "systemd" / "catalog"
    catalog_dir.mkdir(parents=True)
    shutil.copy(CATALOG, catalog_dir / "inferd.catalog")
    update = subprocess.run(
        [journalctl, f"--root={tmp_path}", "--update-catalog"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert update.returncode == 0 and update.stderr == "", update.stderr
    listed = subprocess.run(
        [journalctl, f"--root={tmp_path}", "--list-catalog"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    ids = {line.split()[0] for line in listed}
    assert ids == set(catalog_entries())
    assert all(" inferd: " in line for line in listed)
    ready = message_id("daemon_ready")
    dumped = subprocess.run(
        [journalctl, f"--root={tmp_path}", "--dump-catalog", ready],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert dumped.startswith(f"-- {ready}\nSubject: inferd is ready: @INFERD_STATE@\n")


def test_journalctl_refuses_a_broken_catalog(tmp_path: Path) -> None:
    """The check above can fail: journalctl rejects a file with text before its first id."""
    journalctl = shutil.which("journalctl")
    assert journalctl
    catalog_dir = tmp_path / "usr" / "lib" / "systemd" / "catalog"
    catalog_dir.mkdir(parents=True)
    (catalog_dir / "inferd.catalog").write_text("Subject: no id\n" + CATALOG.read_text())
    update = subprocess.run(
        [journalctl, f"--root={tmp_path}", "--update-catalog"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert update.returncode != 0 and "before ID" in update.stderr
