"""``inferd`` command line: run the daemon, write demo models, check configs."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from inferd.errors import ConfigError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferd", description="onboard inference daemon")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="serve the configured models in the foreground")
    run.add_argument("--config", type=Path, help="TOML config (default: the embedded demo config)")

    demo = commands.add_parser("demo-model", help="write a deterministic demo ONNX model")
    demo.add_argument("path", type=Path)
    demo.add_argument("--kind", choices=("features", "identity"), default="features")

    check = commands.add_parser("check-config", help="validate a config and print it resolved")
    check.add_argument("config", type=Path)

    fdr = commands.add_parser("fdr", help="read the flight data recorder")
    fdr_commands = fdr.add_subparsers(dest="fdr_command", required=True)
    for name, help_text in (("dump", "print records"), ("verify", "check every segment")):
        sub = fdr_commands.add_parser(name, help=help_text)
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--dir", type=Path, help="recorder directory")
        where.add_argument("--config", type=Path, help="take fdr.directory from this config")
        sub.add_argument("--json", action="store_true", help="one JSON document per line")
        if name == "dump":
            sub.add_argument("--kind", action="append", default=[], help="repeatable")
            sub.add_argument("--since", help="15m, 2h, ISO-8601 or epoch seconds")

    verify = commands.add_parser("verify", help="run the engine trust gate on an engine file")
    verify.add_argument("engine", type=Path)
    verify.add_argument("--manifest", type=Path, help="deployment manifest (JSON)")
    verify.add_argument("--json", action="store_true")

    args = parser.parse_args(argv)
    if args.command == "verify":
        from inferd.engines import verify_tool

        return verify_tool.run(args.engine, args.manifest, args.json)
    if args.command == "fdr":
        return _fdr(args)
    if args.command == "demo-model":
        return _demo_model(args.path, args.kind)
    if args.command == "check-config":
        return _check_config(args.config)
    return _run(args.config)


def _demo_model(path: Path, kind: str) -> int:
    from inferd.demo_model import write_demo_model, write_identity_model

    (write_identity_model if kind == "identity" else write_demo_model)(path)
    print(path)
    return EXIT_OK


def _fdr(args: argparse.Namespace) -> int:
    from inferd import config as config_module
    from inferd.fdr import tool

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
        return tool.dump(directory, kinds=args.kind, since_wall_ns=since, as_json=args.json)
    except (ConfigError, ValueError) as exc:
        print(f"inferd: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _check_config(path: Path) -> int:
    from inferd import config

    try:
        loaded = config.load(path)
    except ConfigError as exc:
        print(f"inferd: invalid config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(loaded)
    return EXIT_OK


def _run(config_path: Path | None) -> int:
    from inferd import config as config_module
    from inferd.demo_model import write_demo_model
    from inferd.service.daemon import Daemon, DaemonAlreadyRunningError
    from inferd.service.logging import configure_logging

    try:
        if config_path is None:
            config = config_module.embedded_default()
            demo_path = config.models[0].path
            if not demo_path.exists():
                write_demo_model(demo_path)
        else:
            config = config_module.load(config_path)
    except ConfigError as exc:
        print(f"inferd: invalid config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(config.daemon.log_level, config.daemon.log_format)

    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    daemon = Daemon(config)
    try:
        daemon.start()
    except (DaemonAlreadyRunningError, OSError, TimeoutError) as exc:
        print(f"inferd: cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # e.g. zmq.ZMQError on bind
        print(f"inferd: cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    while not stop.is_set() and not daemon.wait_ready(timeout=0.2):
        pass
    while not stop.wait(0.5):
        daemon.housekeeping()
    daemon.stop()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
