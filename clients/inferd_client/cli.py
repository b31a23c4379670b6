"""``inferctl``: talk to a running inferd from a shell.

This module holds the options, the exit codes and the commands but ``build``
(``cli_build``); what ``infer`` sends is made in ``cli_inputs``, and every result
is written by ``cli_output``: human-readable by default (``cli_format``), while
``--json`` prints one JSON document per result for scripts (strict JSON: a NaN
or an infinity is ``null``), and nothing else on stdout.  Exit codes: 0 ok,
1 the daemon answered with an error (or with a reply that breaks the protocol),
2 usage (what was asked cannot be sent or done: a bad option, a ``--timeout``
of 0 or less, an ``--npy`` that is not a regular .npy file or names an input
twice, an input whose dtype the wire has no name for), 3 unreachable (no socket, a socket inferctl
will not use, no reply within ``--timeout``, or a followed stream went silent),
4 ``health``: the daemon answers but is not serving (starting, degraded,
stopping), 130 a command cut short by Ctrl-C (a followed stream or ``top``,
which Ctrl-C ends, exit 0).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import secrets
import stat
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from inferd_client import cli_build, cli_format
from inferd_client.cli_inputs import describe_array, in_region, load_npy, random_inputs, spec_of
from inferd_client.cli_output import Layout, emit, emit_error, json_line, print_lines
from inferd_client.client import InferenceClient, OperatorClient
from inferd_client.errors import (
    ClientError,
    InvalidArgument,
    MalformedReply,
    RemoteError,
    RequestTimeout,
    Unreachable,
    UnsafeEndpoint,
)
from inferd_client.events import EventSubscriber
from inferd_wire import __version__
from inferd_wire.curve import ClientCurve
from inferd_wire.endpoints import default_endpoints, runtime_dir_and_origin
from inferd_wire.topics import TOPICS, check_topic

EXIT_OK = 0
EXIT_REMOTE_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_SERVING = 4
#: 128 + SIGINT, as a shell reports a command Ctrl-C stopped.
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    defaults = default_endpoints()
    parser = argparse.ArgumentParser(prog="inferctl", description="inferd command line client")
    parser.add_argument("--version", action="version", version=f"inferctl {__version__}")
    parser.add_argument("--infer-endpoint", default=defaults.infer)
    parser.add_argument("--control-endpoint", default=defaults.control)
    parser.add_argument("--events-endpoint", default=defaults.events)
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds to wait for a reply; for events, thermal --follow and build follow: "
        "for any event, health included (the daemon publishes one every second)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--curve-server-key",
        default=os.environ.get("INFERD_CURVE_SERVER_KEY"),
        metavar="KEY|FILE",
        help="tcp:// with CURVE: the daemon's public key (inferd keys show) or a file with it "
        "(default $INFERD_CURVE_SERVER_KEY); a key beginning with '-' (Z85 has it) goes "
        "attached: --curve-server-key=KEY",
    )
    parser.add_argument(
        "--curve-cert",
        type=Path,
        default=os.environ.get("INFERD_CURVE_CERT"),
        metavar="FILE",
        help="tcp:// with CURVE: this client's secret certificate (inferd keys client NAME) "
        "(default $INFERD_CURVE_CERT)",
    )
    # --json is accepted after the subcommand too (inferctl status --json).
    json_option = argparse.ArgumentParser(add_help=False)
    json_option.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    infer = commands.add_parser("infer", parents=[json_option], help="run one inference")
    infer.add_argument("--model", required=True)
    source = infer.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--random",
        action="store_true",
        help="random inputs from the model spec, the same on every call for one --seed",
    )
    source.add_argument(
        "--npy",
        action="append",
        metavar="NAME=FILE.npy",
        help="an input from a .npy file; repeat for each input",
    )
    infer.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for --random (default 0: the same inputs each call)",
    )
    infer.add_argument("--deadline-ms", type=int)
    infer.add_argument("--save", type=Path, help="write outputs to this .npz file")
    infer.add_argument(
        "--shm",
        action="store_true",
        help="pass inputs, and outputs of static shape, in a shared-memory region",
    )

    commands.add_parser("models", parents=[json_option], help="models and their input/output specs")
    commands.add_parser("status", parents=[json_option], help="daemon, model and bus status")
    commands.add_parser("health", parents=[json_option], help="liveness and readiness summary")
    switch = commands.add_parser(
        "switch",
        parents=[json_option],
        help="switch a model's runtime (make-before-break); waits up to --timeout",
    )
    switch.add_argument("model")
    switch.add_argument("runtime", choices=("onnx_trt_ep", "tensorrt"))
    switch.add_argument("--requested-by", default="operator")
    thermal = commands.add_parser(
        "thermal", parents=[json_option], help="thermal telemetry and throttling"
    )
    thermal.add_argument("--follow", action="store_true", help="print every thermal event")
    thermal.add_argument("--count", type=int, default=0, help="with --follow: stop after N")
    build = commands.add_parser("build", help="engine builds run by the daemon")
    build_commands = build.add_subparsers(dest="build_command", required=True)
    build_start = build_commands.add_parser(
        "start", parents=[json_option], help="start a build of MODEL's ONNX file (returns at once)"
    )
    build_start.add_argument("model")
    build_start.add_argument("--precision", choices=("fp32", "fp16", "int8", "mixed"))
    build_start.add_argument("--workspace-bytes", type=int)
    build_start.add_argument("--optimization-level", type=int, choices=range(6))
    build_start.add_argument(
        "--simulated", action="store_true", help="use the simulated builder even with TensorRT"
    )
    build_start.add_argument(
        "--timeout",
        dest="build_timeout_s",
        type=float,
        metavar="S",
        help="the build's deadline: cancelled (source timeout) S seconds after it starts; "
        "at most builds.max_duration_s, the default (not the reply's wait: inferctl --timeout)",
    )
    build_start.add_argument(
        "--stall-after",
        dest="stall_after_s",
        type=float,
        metavar="S",
        help="report a stall when the build made no progress for S seconds (0: never; "
        "default builds.stall_after_s); builds.stall_cancels_after decides a cancel",
    )
    build_status = build_commands.add_parser(
        "status", parents=[json_option], help="phase tree and outcome of one build, or all"
    )
    build_status.add_argument("build_id", nargs="?")
    build_cancel = build_commands.add_parser(
        "cancel", parents=[json_option], help="cancel a build (killed after the grace period)"
    )
    build_cancel.add_argument("build_id")
    build_cancel.add_argument("--source", choices=("control", "ide"), default="control")
    build_follow = build_commands.add_parser(
        "follow",
        parents=[json_option],
        help="print 'build' events as a nested tree (--json: JSON lines) until the build ends",
    )
    build_follow.add_argument("build_id", nargs="?", help="default: the first build seen")
    build_follow.add_argument("--count", type=int, default=0, help="stop after N events")
    top = commands.add_parser("top", help="live view: models, rates, latency, queues, builds")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between status polls")
    events = commands.add_parser("events", parents=[json_option], help="print published events")
    events.add_argument(
        "--topic",
        action="append",
        default=[],
        help=f"repeatable; {', '.join(sorted(TOPICS))} or a prefix of one; default all",
    )
    events.add_argument("--count", type=int, default=0, help="stop after N events (0: forever)")

    args = parser.parse_args(argv)
    try:
        args.curve = _curve(args)
        _check_values(args)
        _check_topics(args)
        _check_sockets(args)
        return _dispatch(args)
    except BrokenPipeError:
        # `inferctl events | head`: the reader left; say nothing, and make the
        # interpreter's final flush of stdout fail quietly too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except RemoteError as exc:
        _emit_error(args, exc.code, exc.message)
        return EXIT_REMOTE_ERROR
    except MalformedReply as exc:
        _emit_error(args, "MALFORMED_REPLY", str(exc))
        return EXIT_REMOTE_ERROR
    except (RequestTimeout, Unreachable, UnsafeEndpoint) as exc:
        _emit_error(args, "UNREACHABLE", str(exc))
        return EXIT_UNREACHABLE
    except (ClientError, OSError, ValueError) as exc:
        # The rest of the client's errors are about what was asked (InvalidArgument,
        # a region too small): the daemon was not at fault, nor out of reach.
        _emit_error(args, "USAGE", str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl-C is how a followed stream or the live view ends; any other command
        # was cut short, and a script must not read that as success.
        return EXIT_OK if _follows(args) else EXIT_INTERRUPTED


def _output_is_a_terminal() -> bool:
    """Whether stdout is a terminal, which ``inferctl top`` draws on."""
    return sys.stdout.isatty()


def _follows(args: argparse.Namespace) -> bool:
    """Whether the command runs until it is stopped (unless given a ``--count``)."""
    return (
        args.command in ("top", "events")
        or (args.command == "thermal" and args.follow)
        or (args.command == "build" and args.build_command == "follow")
    )


def _endpoints_used(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(option, endpoint) of every socket the command needs at once (``top`` waits
    for a daemon that is not there yet, and says so on its screen)."""
    if args.command == "top":
        return []
    infer = ("--infer-endpoint", args.infer_endpoint)
    control = ("--control-endpoint", args.control_endpoint)
    events = ("--events-endpoint", args.events_endpoint)
    if args.command in ("infer", "models"):
        return [infer]
    if args.command == "events" or (args.command == "thermal" and args.follow):
        return [events]
    if args.command == "build" and args.build_command == "follow":
        return [events] + ([control] if args.build_id else [])
    return [control]


def _check_values(args: argparse.Namespace) -> None:
    """Option values no command can use are usage errors, before any socket: a
    ``--timeout`` of 0 s or less would report a daemon that answers as unreachable,
    a build's of 0 s or less, or no end, is one the daemon refuses, and a negative
    ``--count`` would stop after the first event."""
    if not args.timeout > 0:  # NaN too
        shown = "NaN" if math.isnan(args.timeout) else f"{args.timeout:g}"
        raise ValueError(f"--timeout must be a positive number of seconds, got {shown}")
    build_timeout_s = getattr(args, "build_timeout_s", None)
    if build_timeout_s is not None and not 0 < build_timeout_s < math.inf:  # NaN too
        raise ValueError(
            "build start --timeout must be a finite number of seconds more than 0, "
            f"got {build_timeout_s:g}"
        )
    stall_after_s = getattr(args, "stall_after_s", None)
    if stall_after_s is not None and not 0 <= stall_after_s < math.inf:  # NaN too
        raise ValueError(
            "build start --stall-after must be 0 (no stall watchdog) or a finite number of "
            f"seconds, got {stall_after_s:g}"
        )
    count = getattr(args, "count", 0)
    if count < 0:
        raise ValueError(f"--count must be 0 (no limit) or more, got {count}")


def _check_topics(args: argparse.Namespace) -> None:
    """A topic the daemon would refuse (it closes such a subscriber's connection,
    which would only time out here) is a usage error, before any socket."""
    if args.command == "events":
        for topic in args.topic:
            check_topic(topic)


def _check_sockets(args: argparse.Namespace) -> None:
    """Fail at once, saying where it looked, when an ipc:// socket file is missing."""
    runtime_dir, origin = runtime_dir_and_origin()
    for option, endpoint in _endpoints_used(args):
        if not endpoint.startswith("ipc://"):
            continue
        path = Path(endpoint.removeprefix("ipc://"))
        if path.is_socket():
            continue
        where = (
            f"the runtime dir {runtime_dir} (from {origin})"
            if path.parent == runtime_dir
            else f"{path.parent} ({option})"
        )
        raise Unreachable(
            f"no daemon socket at {path}: is inferd running? inferctl looked in {where}; "
            "point it elsewhere with INFERD_RUNTIME_DIR=DIR (the daemon's runtime_dir) or "
            f"{option}"
        )


def _curve(args: argparse.Namespace) -> ClientCurve | None:
    if args.curve_server_key is None and args.curve_cert is None:
        return None
    if args.curve_server_key is None or args.curve_cert is None:
        raise ValueError("CURVE needs both --curve-server-key and --curve-cert")
    return ClientCurve.from_files(args.curve_server_key, Path(args.curve_cert))


def _secured(args: argparse.Namespace, endpoint: str) -> ClientCurve | None:
    """The CURVE keys for ``endpoint``: only tcp:// endpoints use them."""
    curve: ClientCurve | None = args.curve
    return curve if endpoint.startswith("tcp://") else None


def _inference(args: argparse.Namespace) -> InferenceClient:
    endpoint = args.infer_endpoint
    return InferenceClient(endpoint, timeout=args.timeout, curve=_secured(args, endpoint))


def _operator(args: argparse.Namespace) -> OperatorClient:
    endpoint = args.control_endpoint
    return OperatorClient(endpoint, timeout=args.timeout, curve=_secured(args, endpoint))


def _subscriber(args: argparse.Namespace, topics: list[str]) -> EventSubscriber:
    endpoint = args.events_endpoint
    return EventSubscriber(endpoint, topics=topics, curve=_secured(args, endpoint))


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "infer":
        return _infer(args)
    if args.command == "models":
        with _inference(args) as client:
            _emit(args, client.describe(), cli_format.models)
        return EXIT_OK
    if args.command == "switch":
        with _operator(args) as operator:
            _emit(
                args,
                operator.call(
                    "runtime.switch",
                    model=args.model,
                    runtime=args.runtime,
                    requested_by=args.requested_by,
                ),
            )
        return EXIT_OK
    if args.command == "build":
        ended_well = cli_build.run(
            args, lambda: _operator(args), lambda topics: _subscriber(args, topics)
        )
        return EXIT_OK if ended_well else EXIT_REMOTE_ERROR
    if args.command == "top":
        try:
            from inferd_client import top
        except ImportError as exc:  # rich: the [cli] extra, which the library never needs
            raise InvalidArgument(
                f"inferctl top needs rich: pip install 'inferd-client[cli]' ({exc})"
            ) from None
        if not _output_is_a_terminal():  # else it shows nothing, for ever
            raise InvalidArgument(
                "inferctl top needs a terminal: its output is piped or redirected "
                "(a script reads `inferctl --json status`)"
            )
        subscriber = _subscriber(args, list(top.EVENT_TOPICS))
        return top.run(
            lambda: _operator(args),
            subscriber,
            endpoint=args.control_endpoint,
            interval=args.interval,
        )
    if args.command == "thermal" and args.follow:
        args.topic = ["thermal"]
        return _events(args)
    if args.command in ("status", "health", "thermal"):
        with _operator(args) as operator:
            result = operator.call(args.command)
        layout = {
            "status": cli_format.status,
            "health": cli_format.health,
            "thermal": cli_format.thermal,
        }[args.command]
        _emit(args, result, layout)
        if args.command == "health" and result.get("state") != "serving":
            return EXIT_NOT_SERVING
        return EXIT_OK
    return _events(args)


def _infer(args: argparse.Namespace) -> int:
    with _inference(args) as client:
        described = client.describe() if args.random or args.shm else {}
        if args.random:
            inputs = random_inputs(described, args.model, args.seed)
        else:
            inputs = load_npy(args.npy)
        placed: dict[str, np.ndarray] = {}
        if args.shm:
            inputs, placed = in_region(client, inputs, spec_of(described, args.model))
        outputs = client.infer(
            args.model, inputs, outputs=placed or None, deadline_ms=args.deadline_ms
        )
        reply = client.last_reply
        if args.save:
            _save_npz(args.save, outputs)
        summary: dict[str, Any] = {
            "model": args.model,
            "runtime": reply.get("runtime"),
            "fallback": reply.get("fallback"),
            "latency_us": reply.get("latency_us"),
            "late": reply.get("late", False),
            "inputs": {name: describe_array(array) for name, array in inputs.items()},
            "outputs": {name: describe_array(array) for name, array in outputs.items()},
        }
        if args.shm:
            summary["shm"] = {
                "socket": client.last_transport,
                "inputs_in_region": sorted(inputs),
                "outputs_in_region": sorted(
                    entry["name"] for entry in reply.get("outputs", []) if "region" in entry
                ),
            }
    _emit(args, summary, cli_format.inference)
    return EXIT_OK


def _save_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """``arrays`` as an .npz archive at exactly ``path`` (``np.load`` reads it: one
    ``NAME.npy`` member per output, stored, as ``np.savez`` writes them), each under
    its output's name, whatever the name: ``np.savez(file, **arrays)`` took an output
    named ``allow_pickle`` for its argument (not saved) and failed on one named
    ``file``.  Written to a new file beside the file and renamed over it once whole:
    a failure leaves whatever was there.

    Otherwise as ``open(path, "wb")`` writes (review R2, F3): through a symlink to
    the file it names (the link kept; made when missing); a file already there
    keeps its mode, and its owner and group where the caller may set them, and
    one the caller may not write is refused; what is not a regular file (a
    terminal, a pipe, ``/dev/stdout``) is written into, since nothing can be
    renamed over it.  An error names ``path``, never the file beside it."""
    temporary: Path | None = None
    try:
        try:
            existing: os.stat_result | None = os.stat(path)
        except FileNotFoundError:
            existing = None
        if existing is not None and not stat.S_ISREG(existing.st_mode):
            with open(path, "wb") as stream:
                _write_npz(stream, arrays)
            return
        target = Path(os.path.realpath(path))
        if existing is not None:
            # May it be written, as open() asks (EACCES, EROFS): never truncated here.
            os.close(os.open(target, os.O_WRONLY | os.O_CLOEXEC))
        beside = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
        try:
            # As open() makes a file (0666 less the umask), never over one already there.
            fd = os.open(beside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if existing is None:
                raise  # as open() would have failed: the directory is the path's
            why = exc.strerror or str(exc)
            raise OSError(
                exc.errno, f"no new file can be made in {target.parent} ({why})"
            ) from None
        temporary = beside
        with os.fdopen(fd, "wb") as stream:
            if existing is not None:
                if (existing.st_uid, existing.st_gid) != (os.geteuid(), os.getegid()):
                    # Before the mode: a change of owner clears set-id bits.
                    with contextlib.suppress(PermissionError):
                        os.fchown(fd, existing.st_uid, existing.st_gid)
                os.fchmod(fd, stat.S_IMODE(existing.st_mode))
            _write_npz(stream, arrays)
        os.replace(temporary, target)
        temporary = None
    except OSError as exc:
        raise ClientError(f"cannot save the outputs to {path}: {exc.strerror or exc}") from None
    finally:
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()


def _write_npz(stream: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """``arrays`` as an .npz archive on ``stream`` (one that cannot seek too: zipfile
    then writes each member's sizes after it)."""
    with zipfile.ZipFile(stream, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def _events(args: argparse.Namespace) -> int:
    received = 0
    with _subscriber(args, args.topic) as subscriber:
        subscriber.wait_joined(args.timeout, keep_health=True)
        topics = ", ".join(args.topic) if args.topic else "all"
        print(f"following events ({topics})", file=sys.stderr, flush=True)
        for topic, payload in subscriber.follow(args.timeout, on_rejoined=cli_build.say_rejoined):
            if args.json:
                print(json_line({"topic": topic, **payload}), flush=True)
            else:
                print_lines([cli_format.event(topic, payload)])
            received += 1
            if args.count and received >= args.count:
                return EXIT_OK
    return EXIT_OK


def _emit(args: argparse.Namespace, document: dict[str, Any], layout: Layout | None = None) -> None:
    emit(args.json, document, layout)


def _emit_error(args: argparse.Namespace, code: str, message: str) -> None:
    emit_error(args.json, code, message)


if __name__ == "__main__":
    sys.exit(main())
