"""``inferd`` command line: run the daemon, write demo models, check configs."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import inferd
from inferd.errors import (
    ConfigError,
    ProcessLimitError,
    UncheckedDirectoryError,
    UnsafeDirectoryError,
)
from inferd.owned_files import apply_owned_umask, ensure_owned_dir
from inferd.process_start import prepare_process

if TYPE_CHECKING:
    from inferd.cli.run_signals import RunSignals
    from inferd.config import Config
    from inferd.daemon import Daemon
    from inferd.supervision.notify import Notifier
    from inferd.supervision.watchdog import Watchdog

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    if _command_of(sys.argv[1:] if argv is None else argv) == "run":
        # SIGHUP is logged and ignored once the daemon's handler is in (_run), and
        # before it too: by default it ends the process, which systemd counts as
        # a clean exit (no restart).  First, before the parser's imports.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    prepare_process()
    parser = argparse.ArgumentParser(prog="inferd", description="onboard inference daemon")
    parser.add_argument("--version", action="version", version=f"inferd {inferd.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="serve the configured models in the foreground")
    run.add_argument("--config", type=Path, help="TOML config (default: the embedded demo config)")
    run.add_argument(
        "--log-format",
        choices=("auto", "console", "json", "journald"),
        help="override daemon.log_format (auto: journald under systemd, else console)",
    )

    demo = commands.add_parser("demo-model", help="write a deterministic demo ONNX model")
    demo.add_argument("path", type=Path)
    demo.add_argument("--kind", choices=("features", "identity"), default="features")

    check = commands.add_parser("check-config", help="validate a config and print it resolved")
    check.add_argument("config", type=Path)

    fdr = commands.add_parser("fdr", help="read the flight data recorder")
    fdr_commands = fdr.add_subparsers(dest="fdr_command", required=True)
    for name, help_text in (
        ("dump", "print records"),
        ("verify", "check every segment"),
        ("export", "write records for other tools (--mcap: Foxglove, MCAP readers)"),
    ):
        sub = fdr_commands.add_parser(name, help=help_text)
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--dir", type=Path, help="recorder directory")
        where.add_argument("--config", type=Path, help="take fdr.directory from this config")
        if name == "export":
            sub.add_argument("--mcap", type=Path, required=True, metavar="OUT", help="MCAP file")
        else:
            sub.add_argument("--json", action="store_true", help="one JSON document per line")
        if name in ("dump", "export"):
            sub.add_argument("--kind", action="append", default=[], help="repeatable")
            sub.add_argument("--since", help="15m, 2h, ISO-8601 or epoch seconds")

    build = commands.add_parser(
        "build", help="build (or reuse) a TensorRT engine pre-flight, without a daemon"
    )
    from inferd.cli import build as tensorrt_cli

    tensorrt_cli.add_arguments(build)

    acceptance = commands.add_parser("acceptance", help="product acceptance tests")
    acceptance_commands = acceptance.add_subparsers(dest="acceptance_command", required=True)
    stuck = acceptance_commands.add_parser(
        "stuck-build", help="build observability/cancellation scenarios; writes an evidence bundle"
    )
    stuck.add_argument("--out", type=Path, default=Path("stuck-build-evidence"))

    verify = commands.add_parser("verify", help="run the engine trust gate on an engine file")
    verify.add_argument("engine", type=Path)
    verify.add_argument("--manifest", type=Path, help="deployment manifest (JSON)")
    verify.add_argument("--json", action="store_true")

    keys = commands.add_parser("keys", help="CURVE keys for tcp:// endpoints (security.curve)")
    from inferd.cli import keys as keys_cli

    keys_cli.add_arguments(keys)

    selftest = commands.add_parser(
        "selftest", help="run the checks fakes cannot make, on this machine (GPU ones where it can)"
    )
    from inferd.cli import selftest as selftest_cli

    selftest_cli.add_arguments(selftest)

    args = parser.parse_args(argv)
    # The unit's UMask=0027 outside systemd too: engines, caches and the FDR are never
    # world-readable (DESIGN.md, "The daemon's own directories").
    apply_owned_umask()
    if args.command != "run":
        from inferd.supervision.logging import log_to_stderr

        log_to_stderr()  # the daemon configures its own from daemon.log_format
    try:
        return _dispatch(args)
    except BrokenPipeError:
        if args.command == "run":
            # Not a result's reader gone: the daemon says its failures through
            # _say, so this is a bug; exit 1, never 0 (systemd would not restart).
            raise
        # `inferd fdr dump | head`: the reader left; end quietly, and let the
        # interpreter's last flush of stdout fail quietly too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand, before the parser exists: the first word that is no option
    (the only options before it, ``--help`` and ``--version``, take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "acceptance":
        from inferd.engine_build import acceptance as acceptance_module

        return acceptance_module.run(args.out)
    if args.command == "build":
        from inferd.cli import build as tensorrt_cli

        return tensorrt_cli.run_from_args(args)
    if args.command == "selftest":
        from inferd.cli import selftest as selftest_cli

        return selftest_cli.run_from_args(args)
    if args.command == "keys":
        from inferd.cli import keys as keys_cli

        return keys_cli.run_from_args(args)
    if args.command == "verify":
        from inferd.cli import verify as verify_tool

        return verify_tool.run(args.engine, args.manifest, args.json)
    if args.command == "fdr":
        return _fdr(args)
    if args.command == "demo-model":
        return _demo_model(args.path, args.kind)
    if args.command == "check-config":
        from inferd.cli.check_config import check_config

        return check_config(args.config)
    return _run(args.config, args.log_format)


def _demo_model(path: Path, kind: str) -> int:
    from inferd.demo_model import write_demo_model, write_identity_model

    (write_identity_model if kind == "identity" else write_demo_model)(path)
    print(path)
    return EXIT_OK


def _fdr(args: argparse.Namespace) -> int:
    from inferd import config as config_module
    from inferd.cli import fdr as tool

    try:
        if args.dir is not None:
            directory = args.dir
        elif args.config is not None:
            directory = config_module.load(args.config).fdr.directory
        else:
            directory = config_module.embedded_default().fdr.directory
        if not directory.is_dir():
            print(f"inferd: no recorder directory at {directory}", file=sys.stderr)
            return EXIT_USAGE
        if args.fdr_command == "verify":
            return tool.verify(directory, as_json=args.json)
        since = tool.parse_since(args.since) if args.since else None
        kinds = tool.check_kinds(args.kind)
        if args.fdr_command == "export":
            return tool.export(directory, args.mcap, kinds=kinds, since_wall_ns=since)
        return tool.dump(directory, kinds=kinds, since_wall_ns=since, as_json=args.json)
    except (ConfigError, ValueError) as exc:
        print(f"inferd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        raise  # `inferd fdr dump | head`: main() ends quietly
    except OSError as exc:  # a recorder directory this user may not list
        print(f"inferd: cannot read the recorder directory: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _run(config_path: Path | None, log_format: str | None = None) -> int:
    from inferd import config as config_module
    from inferd.cli.run_signals import RunSignals
    from inferd.demo_model import write_demo_model
    from inferd.startup import log_start_failed
    from inferd.supervision.logging import configure_logging
    from inferd.supervision.notify import Notifier

    # Before the config: a config refused says why to systemd too (STATUS=).
    notifier = Notifier.from_environment()
    source = "<embedded default>" if config_path is None else str(config_path)
    try:
        if config_path is None:
            config = config_module.embedded_default()
        else:
            config = config_module.load(config_path)
    except ConfigError as exc:
        return _invalid_config(notifier, source, exc)
    log_format = configure_logging(config.daemon.log_level, log_format or config.daemon.log_format)
    try:
        ensure_owned_dir(config.daemon.state_dir, what="daemon.state_dir")
        if config_path is None and not config.models[0].path.exists():
            demo_path = config.models[0].path
            write_demo_model(
                ensure_owned_dir(demo_path.parent, what="the models dir") / demo_path.name
            )
    except (OSError, UnsafeDirectoryError) as exc:  # a directory, or the demo model (ENOSPC)
        log_start_failed("state_dir", exc)
        return _cannot_start(notifier, source, exc)
    # When the systemd watchdog fires it sends SIGABRT: dump every thread's stack
    # to stderr (the journal under systemd) first, so the stuck call is visible.
    faulthandler.enable(all_threads=True)
    with RunSignals() as signals:  # handlers that take no lock (run_signals.py)
        return _run_daemon(config, notifier, source, log_format, signals)


def _run_daemon(
    config: Config, notifier: Notifier, source: str, log_format: str, signals: RunSignals
) -> int:
    from inferd.daemon import Daemon
    from inferd.startup import log_start_failed
    from inferd.supervision.watchdog import Watchdog, WatchdogSettings

    watchdog_settings = WatchdogSettings.from_environment()
    try:  # EMFILE making the context or the shm socketpair; a bug: as a failed start
        daemon = Daemon(config)
    except Exception as exc:
        log_start_failed("daemon.init", exc)
        return _cannot_start(notifier, source, exc)
    supervision = {
        "log_format": log_format,
        "notify": notifier.backend_name if notifier.enabled else None,
        "watchdog_s": watchdog_settings.interval_s if watchdog_settings else None,
    }
    try:
        daemon.start(supervision)
    except Exception as exc:  # logged by the daemon (daemon_start_failed), then released
        return _cannot_start(notifier, source, exc)

    def stopping() -> None:
        notifier.stopping(daemon.status_line(), extend_s=daemon.stop_budget_s())

    try:
        watchdog = (
            Watchdog(notifier, watchdog_settings, daemon.liveness, record=daemon.record)
            if watchdog_settings
            else None
        )
        _start_up(daemon, notifier, watchdog, signals, signals.hangups)
        if not signals.is_set() and daemon.failed is None:
            notifier.ready(daemon.status_line())
            _serve(daemon, notifier, watchdog, signals, signals.hangups)
    finally:  # also after a bug in the loop (it then goes on, with its traceback, exit 1)
        daemon.stop(on_stopping=stopping)
    if daemon.failed is not None:
        # Exit in failure: systemd's Restart=on-failure brings a fresh process.
        notifier.status(f"failed: {daemon.failed}")
        _say(f"inferd: {daemon.failed}")
        return EXIT_FAILURE
    notifier.status("stopped")
    return EXIT_OK


def _invalid_config(notifier: Notifier, source: str, exc: ConfigError) -> int:
    """The file and the key (the message names it), as ``check-config`` says them,
    on stderr (the journal under systemd) and in ``STATUS=`` (``systemctl status``)."""
    notifier.failed(f"invalid config {source}: {exc}")
    _say(f"inferd: invalid config {source}: {exc}")
    return EXIT_USAGE  # RestartPreventExitStatus=2: a restart would fail the same way


#: What a restart would meet again, as a config error: exit 2 (the units'
#: ``RestartPreventExitStatus=2``).  A limit (``LimitNOFILE=``, ``vm.max_map_count``),
#: or a directory another user owns or may write: systemd re-applies its own
#: directories' owner at each start (``RuntimeDirectory=``, ``StateDirectory=``)
#: but leaves a mode changed since, so what is wrong is the operator's to fix;
#: the units' few quick retries would only end in ``start-limit-hit``.  Also what
#: is planted at ``inferd.lock`` in such a directory (``UnsafeLockFileError``).
#: Not a directory that could not be made or checked for want of descriptors,
#: memory or space (``UncheckedDirectoryError``): a restart may find them back.
_NOT_RESTARTED = (ProcessLimitError, UnsafeDirectoryError)


def _cannot_start(notifier: Notifier, source: str, exc: Exception) -> int:
    """Why the start failed, on stderr (the journal under systemd) and in ``STATUS=``,
    with ``ERRNO=`` when the error has one (a taken port: ``EADDRINUSE``); a bug's
    with its type (``startup.start_error``).  Exit 2 for a config error and what
    ``_NOT_RESTARTED`` holds, 1 for what a restart may find gone (the lock held)."""
    from inferd.startup import start_error
    from inferd.supervision.notify import errno_of

    if isinstance(exc, ConfigError):  # found only at start (a key:NAME without its key file)
        return _invalid_config(notifier, source, exc)
    said = f"cannot start: {start_error(exc)}"
    notifier.failed(said, errno_of(exc))
    _say(f"inferd: {said}")
    restarted = not isinstance(exc, _NOT_RESTARTED) or isinstance(exc, UncheckedDirectoryError)
    return EXIT_FAILURE if restarted else EXIT_USAGE


def _say(line: str) -> None:
    """``inferd run``'s own line on stderr, after ``STATUS=``: a stderr whose reader
    has gone (a log collector that died) loses the line, never the exit status
    (``CurrentStderrLogger`` counts it, as it does the log's lines)."""
    from inferd.supervision.logging import CurrentStderrLogger

    CurrentStderrLogger().msg(line)


class StopRequest(Protocol):
    """What the loops read of the stop (``RunSignals``; a ``threading.Event`` too)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


#: The main loop's longest sleep (housekeeping, STATUS= updates).
_TICK_S = 0.5


def _start_up(
    daemon: Daemon,
    notifier: Notifier,
    watchdog: Watchdog | None,
    stop: StopRequest,
    hangups: list[int],
) -> None:
    """Wait for every model to serve or fail over.  Each step of progress (a model
    starting or finishing its load, a progress report) extends systemd's start
    timeout by ``daemon.startup_extend_s``, or by the declared load's
    ``max_load_s`` when that is longer: a long but progressing start-up survives
    TimeoutStartSec= and a stuck one does not.  The watchdog reports (no pings:
    systemd arms it at READY=1), and ``STATUS=`` says what start-up waits for."""
    from inferd.supervision.watchdog import startup_extension_s

    extend_s = daemon.config.daemon.startup_extend_s
    last_progress = None
    while not stop.is_set():
        progress = daemon.startup_progress()
        if progress != last_progress:
            last_progress = progress
            threads = daemon.liveness()
            notifier.extend_timeout(startup_extension_s(threads, time.monotonic_ns(), extend_s))
        if watchdog is not None:
            watchdog.tick(ready=False)
        _status(daemon, notifier, watchdog)
        _log_hangups(hangups)
        if daemon.wait_ready(timeout=0.2) or daemon.failed is not None:
            return


def _serve(
    daemon: Daemon,
    notifier: Notifier,
    watchdog: Watchdog | None,
    stop: StopRequest,
    hangups: list[int],
) -> None:
    while daemon.failed is None:
        if watchdog is not None:
            watchdog.tick()
        _status(daemon, notifier, watchdog)
        _log_hangups(hangups)
        wait_s = min(_TICK_S, watchdog.due_in_s()) if watchdog is not None else _TICK_S
        if stop.wait(wait_s):
            return
        daemon.housekeeping()


def _status(daemon: Daemon, notifier: Notifier, watchdog: Watchdog | None) -> None:
    """``STATUS=``: the daemon's line, then why pings are withheld or what the
    watchdog waits for (a declared model load), if anything."""
    from inferd.supervision.watchdog import declared_operations, describe_waiting

    line = daemon.status_line()
    if watchdog is not None:
        fragment = watchdog.describe()
    else:
        fragment = describe_waiting(declared_operations(daemon.liveness()), time.monotonic_ns())
    notifier.status(f"{line} | {fragment}" if fragment else line)


def _log_hangups(hangups: list[int]) -> None:
    if hangups:
        import structlog  # not at the top: the command's imports are SIGHUP's window

        hangups.clear()
        structlog.get_logger("inferd.cli").warning(
            "sighup_ignored", reason="reload is not supported; restart inferd to apply a config"
        )


if __name__ == "__main__":
    sys.exit(main())
