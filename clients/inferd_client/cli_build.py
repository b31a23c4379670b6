"""``inferctl build start|status|cancel|follow``: engine builds run by the daemon.

``start``, ``status`` and ``cancel`` are one control op each; ``follow`` prints
the ``build`` topic of the events socket, one build's events, until it ends, and
asks ``build.status`` again after its connection to the events was lost (a
daemon that restarted no longer knows the build, and its end would never come).
The clients come from ``cli`` (its endpoints, timeout and CURVE keys)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from inferd_client import cli_format
from inferd_client.cli_output import UNEXPECTED_SHAPE, emit, json_line, print_lines
from inferd_client.client import OperatorClient
from inferd_client.errors import MalformedReply, RemoteError
from inferd_client.events import EventSubscriber
from inferd_wire.protocol import Code

#: The states, and the event types, of a build that has ended.
TERMINAL = ("cancelled", "completed", "failed")
#: Those of a build that ended without its engine.
UNFINISHED = ("cancelled", "failed")


def run(
    args: argparse.Namespace,
    operator: Callable[[], OperatorClient],
    subscriber: Callable[[list[str]], EventSubscriber],
) -> bool:
    """The ``build`` subcommand in ``args``; raises the client's errors.  False when
    ``follow`` saw its build end failed or cancelled (``inferctl`` exits 1 then, so
    ``build follow ID && ...`` stops there)."""
    if args.build_command == "follow":
        return follow(args, operator, subscriber)
    with operator() as control:
        if args.build_command == "start":
            config = {
                key: value
                for key, value in (
                    ("precision", args.precision),
                    ("workspace_bytes", args.workspace_bytes),
                    ("optimization_level", args.optimization_level),
                )
                if value is not None
            }
            arguments: dict[str, Any] = {"model": args.model}
            if config:
                arguments["build_config"] = config
            if args.simulated:
                arguments["builder"] = "simulated"
            if args.build_timeout_s is not None:
                arguments["timeout_s"] = args.build_timeout_s
            if args.stall_after_s is not None:
                arguments["stall_after_s"] = args.stall_after_s
            emit(args.json, control.call("build.start", **arguments))
        elif args.build_command == "status":
            arguments = {} if args.build_id is None else {"build_id": args.build_id}
            emit(args.json, control.call("build.status", **arguments), _builds)
        else:
            emit(
                args.json,
                control.call("build.cancel", build_id=args.build_id, source=args.source),
            )
    return True


def follow(
    args: argparse.Namespace,
    operator: Callable[[], OperatorClient],
    subscriber: Callable[[list[str]], EventSubscriber],
) -> bool:
    """Print one build's events until it ends: JSON lines, or indented by phase depth.
    False when it ended failed or cancelled."""
    depth: dict[str, int] = {}
    followed: str | None = args.build_id
    received = 0

    def rejoined(lost: int) -> None:
        # The daemon restarted (or the connection ended): the build's events since are
        # missed, and a build whose end was among them would be followed for good.
        say_rejoined(lost, "" if followed is None else f"asking build.status of {followed} again")
        if followed is not None:
            _show_state(args, _status_again(operator, followed))

    with subscriber(["build"]) as events:
        # Join first (follow joins before its first event), then read the build's
        # state: an event published after the snapshot is then never lost to
        # ZeroMQ's slow joiner.
        events.wait_joined(args.timeout, keep_health=True)
        print("following build events", file=sys.stderr, flush=True)
        try:
            if followed is not None:
                _show_state(args, _status(operator, followed))
            for _topic, event in events.follow(args.timeout, on_rejoined=rejoined):
                followed = followed or event.get("buildId")
                if event.get("buildId") != followed:
                    continue
                received += 1
                if args.json:
                    print(json_line(event), flush=True)
                else:
                    print_lines([_event_line(event, depth)])
                if event.get("type") in TERMINAL:
                    return event.get("type") not in UNFINISHED
                if args.count and received >= args.count:
                    return True
        except _Ended as ended:
            return ended.well
    return True


def say_rejoined(lost: int, then: str = "") -> None:
    """One line on stderr: ``EventSubscriber.follow`` is back after ``lost`` lost
    connections (a daemon restart), and the events published meanwhile were missed,
    which the output does not show; ``then``: what inferctl does about it."""
    times = "" if lost == 1 else f" ({lost} times)"
    print(
        cli_format.printable(
            f"inferctl: the connection to the daemon's events was lost{times} and made "
            "again: events published meanwhile were missed" + (f"; {then}" if then else "")
        ),
        file=sys.stderr,
        flush=True,
    )


class _Ended(Exception):
    """The followed build's state, read over ``control``, says it has ended."""

    def __init__(self, well: bool) -> None:
        super().__init__()
        self.well = well


def _status(operator: Callable[[], OperatorClient], build_id: str) -> dict[str, Any]:
    """``build.status`` of ``build_id``: its ``build`` map."""
    with operator() as control:
        build = control.call("build.status", build_id=build_id).get("build")
    if not isinstance(build, dict):
        raise MalformedReply(f"build.status of {build_id!r} has no 'build' map")
    return build


def _status_again(operator: Callable[[], OperatorClient], build_id: str) -> dict[str, Any]:
    """``_status`` after the events' connection was lost: a daemon that restarted
    no longer knows the build (``NOT_FOUND``), said so."""
    try:
        return _status(operator, build_id)
    except RemoteError as exc:
        if exc.code != Code.NOT_FOUND:
            raise
        raise RemoteError(
            exc.code,
            f"build {build_id} is gone: the connection to the daemon was lost and made "
            f"again, and the daemon no longer knows the build (it restarted): {exc.message}",
        ) from None


def _show_state(args: argparse.Namespace, build: dict[str, Any]) -> None:
    """Print the build's state (a JSON line ``{"type": "status", ...}`` or its human
    layout); ``_Ended`` when it has ended."""
    if args.json:
        print(json_line({"type": "status", "build": build}), flush=True)
    else:
        emit(False, build, cli_format.build)
    if build.get("state") in TERMINAL:
        raise _Ended(build.get("state") not in UNFINISHED)


def _builds(reply: dict[str, Any]) -> list[str]:
    """``build.status``'s builds (all, or the one asked for), each as ``cli_format.build``;
    then the count of those the listing left out to fit its reply."""
    builds = reply["builds"] if "builds" in reply else [reply["build"]]
    lines = [line for build in builds for line in cli_format.build(build)]
    if reply.get("builds_omitted"):
        lines.append(
            f"{reply['builds_omitted']} older builds not listed (the reply's bound); "
            "inferctl build status ID shows one"
        )
    return lines


def _event_line(event: dict[str, Any], depth: dict[str, int]) -> str:
    """``cli_format.build_event``'s line, or the event as it came when it has a shape
    that line does not know (a daemon of another version)."""
    try:
        return cli_format.build_event(event, depth)
    except UNEXPECTED_SHAPE:
        return cli_format.text(event)
