"""``inferctl build start|status|cancel|follow``: engine builds run by the daemon.

``start``, ``status`` and ``cancel`` are one control op each; ``follow`` prints
the ``build`` topic of the events socket, one build's events, until it ends.
The clients come from ``cli`` (its endpoints, timeout and CURVE keys)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from inferd_client import cli_format
from inferd_client.cli_output import UNEXPECTED_SHAPE, emit, json_line, print_lines
from inferd_client.client import OperatorClient
from inferd_client.errors import MalformedReply
from inferd_client.events import EventSubscriber

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
    with subscriber(["build"]) as events:
        # Join first (follow joins before its first event), then read the build's
        # state: an event published after the snapshot is then never lost to
        # ZeroMQ's slow joiner.
        events.wait_joined(args.timeout, keep_health=True)
        print("following build events", file=sys.stderr, flush=True)
        if followed is not None:
            with operator() as control:
                build = control.call("build.status", build_id=followed).get("build")
            if not isinstance(build, dict):
                raise MalformedReply(f"build.status of {followed!r} has no 'build' map")
            if args.json:
                print(json_line({"type": "status", "build": build}), flush=True)
            else:
                emit(False, build, cli_format.build)
            if build.get("state") in TERMINAL:
                return build.get("state") not in UNFINISHED
        for _topic, event in events.follow(args.timeout):
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
    return True


def _builds(reply: dict[str, Any]) -> list[str]:
    """``build.status``'s builds (all, or the one asked for), each as ``cli_format.build``."""
    builds = reply["builds"] if "builds" in reply else [reply["build"]]
    return [line for build in builds for line in cli_format.build(build)]


def _event_line(event: dict[str, Any], depth: dict[str, int]) -> str:
    """``cli_format.build_event``'s line, or the event as it came when it has a shape
    that line does not know (a daemon of another version)."""
    try:
        return cli_format.build_event(event, depth)
    except UNEXPECTED_SHAPE:
        return cli_format.text(event)
