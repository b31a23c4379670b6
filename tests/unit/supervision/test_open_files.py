"""The daemon raises its soft ``RLIMIT_NOFILE`` to the hard one at start and refuses
to start when three sockets of ``bus.max_connections``, the shm socket's share and
the reserve do not fit (``supervision/open_files.py``, DESIGN.md 128): clients
within every bound could then make libzmq abort it.  Each case runs in a child
process, whose limits it may lower without touching the test run's."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from inferd.supervision.open_files import descriptors_needed
from tests.conftest import HANG_S, REPO, render_config

CHILD = """
import json, resource, sys
from pathlib import Path
import structlog
events = []
structlog.configure(processors=[structlog.processors.add_log_level,
                                lambda _l, _m, event: events.append(event) or ""],
                    logger_factory=structlog.ReturnLoggerFactory())
soft, hard, connections = (int(value) for value in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from inferd.config import ShmConfig
from inferd.errors import OpenFilesLimitError
from inferd.supervision.open_files import raise_open_files_limit
shm = ShmConfig(socket=Path("/run/inferd/shm.sock"), enabled=False)
if len(sys.argv) > 4:
    shm_connections, regions = (int(value) for value in sys.argv[4:6])
    shm = ShmConfig(socket=Path("/run/inferd/shm.sock"), max_connections=shm_connections,
                    max_regions_per_connection=regions)
limit, refused = None, None
try:
    limit = raise_open_files_limit(connections, shm)
except OpenFilesLimitError as exc:
    refused = {"message": str(exc), "limit": exc.limit, "needed": exc.needed}
print(json.dumps({"limit": limit, "refused": refused,
                  "now": resource.getrlimit(resource.RLIMIT_NOFILE),
                  "events": [event["event"] for event in events],
                  "levels": [event.get("level") for event in events],
                  "needed": [event.get("needed") for event in events]}))
"""


def run(
    soft: int, hard: int, max_connections: int, shm: tuple[int, int] | None = None
) -> dict[str, Any]:
    """``raise_open_files_limit`` in a child with these limits; ``shm``: its
    ``shm.max_connections`` and ``max_regions_per_connection`` (None: disabled)."""
    shm_args = [] if shm is None else [str(value) for value in shm]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(soft), str(hard), str(max_connections), *shm_args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    result = run(256, 4096, 256)
    assert result["limit"] == 4096 and result["now"] == [4096, 4096]
    assert result["events"] == ["open_files_limit"]


def test_a_limit_too_low_for_the_sockets_refuses_to_start_naming_what_to_change() -> None:
    result = run(256, 1500, 256)  # 3 x 256 + 1024 = 1792 needed
    assert result["limit"] is None, "started with a limit its bounds do not fit"
    refused = result["refused"]
    assert (refused["limit"], refused["needed"]) == (1500, 1792)
    message = refused["message"]
    assert "RLIMIT_NOFILE) is 1500, below the 1792" in message
    assert "3 sockets x bus.max_connections 256" in message
    for change in ("LimitNOFILE=", "bus.max_connections", "shm.max_connections"):
        assert change in message
    assert "shm.max_regions_per_connection" in message
    assert (result["events"], result["levels"]) == (["open_files_limit_low"], ["error"])
    assert result["now"] == [1500, 1500]  # raised as far as it goes before refusing


def test_a_limit_that_just_fits_starts() -> None:
    result = run(256, 1792, 256)
    assert (result["limit"], result["refused"], result["events"]) == (
        1792,
        None,
        ["open_files_limit"],
    )


#: ``inferd run`` under a hard limit of ``sys.argv[1]`` (the rest: its arguments).
LIMITED_RUN = """
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
from inferd.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def run_notified(
    tmp_path: Path, argv: list[str]
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``python argv`` to its end, with a ``NOTIFY_SOCKET`` of its own: how it ended,
    and the lines of the one notification it sent (systemd's ``STATUS=``, ``ERRNO=``)."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    try:
        done = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=HANG_S * 4,
            cwd=REPO,
            env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")},
        )
        notify.setblocking(False)
        sent = notify.recv(65536).decode().split("\n")
    finally:
        notify.close()
    return done, sent


def test_inferd_run_under_a_low_limit_exits_2_and_tells_systemd_why(tmp_path: Path) -> None:
    """The defaults need 2,450 descriptors: under 1,500 ``inferd run`` refuses before
    binding anything, exit 2 (``RestartPreventExitStatus=2``: a restart would fail
    the same way), naming the limit, the count and what to change, on stderr and in
    ``STATUS=``/``ERRNO=`` to systemd."""
    from inferd.config import load

    config = tmp_path / "inferd.toml"
    config.write_text(render_config(tmp_path, [{"name": "m", "path": str(tmp_path / "m.onnx")}]))
    loaded = load(config)
    needed = descriptors_needed(loaded.bus.max_connections, loaded.shm)
    assert needed > 1500
    done, sent = run_notified(tmp_path, ["-c", LIMITED_RUN, "1500", "run", "--config", str(config)])
    assert done.returncode == 2, done.stderr
    refusal = "the limit on open descriptors (RLIMIT_NOFILE) is 1500, below the"
    assert f"inferd: cannot start: {refusal} {needed} " in done.stderr
    assert "LimitNOFILE=" in done.stderr and "Traceback" not in done.stderr
    assert "open_files_limit_low" in done.stdout + done.stderr  # the log event, kept
    assert f"ERRNO={errno.EMFILE}" in sent
    assert any(line.startswith("STATUS=cannot start: the limit on open") for line in sent)
    assert not (tmp_path / "run" / "infer.sock").exists()  # nothing bound


def test_check_config_says_how_many_descriptors_the_config_needs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Said, not checked: ``check-config`` runs in the operator's shell, whose limit
    is not the unit's, so it names the count to compare with ``LimitNOFILE=``."""
    from inferd.cli.main import main

    (tmp_path / "m.onnx").write_bytes(b"")
    config = tmp_path / "inferd.toml"
    models = [{"name": "m", "path": str(tmp_path / "m.onnx")}]
    config.write_text(render_config(tmp_path, models, bus={"max_connections": 100}))
    assert main(["check-config", str(config)]) == 0
    needed = 3 * 100 + 658 + 1024  # the shm socket's share at its defaults: 658
    # A note, printed whatever the limits here: not a warning (docs/OPERATIONS.md).
    assert f"inferd: note: {config} needs {needed} open descriptors" in capsys.readouterr().err
