"""The build child process: ``python -m inferd.engine_build.child SPEC_JSON``.

The daemon (``inferd.engine_build.supervisor``) starts one per ``build.start``.  It is a
fresh interpreter (``exec``, ``close_fds``): it inherits no ZeroMQ socket or
thread of the daemon.  It reads cancel commands on stdin and writes its messages
on a private copy of its original stdout (fd 1 is pointed at stderr); the wire
protocol is ``inferd.engine_build.pipe``.

Events go through a bounded queue to a writer thread: a slow daemon loses
``step`` detail (counted in the report message), never stalls the builder.
SIGINT is ignored (a terminal's Ctrl-C belongs to the daemon); SIGTERM (e.g.
systemd stopping the unit's whole cgroup) cancels with source ``sigterm``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.events import BuildEvent
from inferd.engine_build.pipe import (
    ChildMessage,
    EnginePathMessage,
    ErrorMessage,
    EventMessage,
    RecordMessage,
    ReportMessage,
    command_decoder,
    encode,
)
from inferd.engine_build.relay import EventRelay
from inferd.engine_build.session import Builder, BuildRequest, run_build
from inferd.engine_build.simulated import SimSettings, SimulatedBuilder
from inferd.engines.build_config import parse_build_config
from inferd.types import BuildConfig, HostTuple, PrecisionMode

#: The host tuple a simulated build claims (it never touches a GPU).
SIMULATED_HOST = HostTuple((8, 7), "simulated", "none", "10.3.0.30", PrecisionMode.FP32)
_QUEUE_SIZE = 2048


class _Writer:
    """The pipe's writer thread behind an ``EventRelay``: a slow daemon loses
    ``step`` events (counted in the report), never phase boundaries, records or
    the report, and never stalls the builder."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._broken = False
        self._relay: EventRelay[ChildMessage] = EventRelay(
            self._write, capacity=_QUEUE_SIZE, name="inferd-build-writer"
        )

    @property
    def dropped(self) -> int:
        return self._relay.dropped

    def event(self, event: BuildEvent) -> None:
        if event.type == "step":
            self._relay.offer(EventMessage(event))
        else:
            self._relay.put(EventMessage(event))

    def send(self, message: ChildMessage) -> None:
        self._relay.put(message)

    def close(self) -> None:
        self._relay.close(timeout=30)

    def _write(self, message: ChildMessage) -> None:
        if self._broken:
            return
        try:
            self._out.write(encode(message))
            self._out.flush()
        except (OSError, ValueError):
            self._broken = True  # the daemon went away; stdin EOF cancels the build


def _read_commands(token: CancellationToken, ignore_cancel: bool) -> None:
    decoder = command_decoder()
    stdin = sys.stdin.buffer
    while True:
        try:
            chunk = os.read(stdin.fileno(), 4096)
        except OSError:
            chunk = b""
        if not chunk:
            if not ignore_cancel:
                token.cancel("sigterm", "the daemon closed the build's control pipe")
            return
        for command in decoder.feed(chunk):
            if ignore_cancel:  # test knob: a child that never stops by itself
                print("build child ignores cancel (test knob)", file=sys.stderr, flush=True)
                continue
            token.cancel(command.source, command.reason)


def stall_watchdog(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``BuildRequest`` keys of the spec's stall watchdog: none for a spec without
    ``stall_after_s`` (an older daemon's) or with 0; ``stall_cancels_after`` 0 (or
    none): stalls are only reported (the watchdog's None: its 0 cancelled at once)."""
    after = float(spec.get("stall_after_s") or 0.0)
    cancels = int(spec.get("stall_cancels_after") or 0)
    return {
        "stall_after_s": after if after > 0 else None,
        "stall_cancels_after": cancels if after > 0 and cancels > 0 else None,
    }


def _builder(spec: dict[str, Any], config: BuildConfig) -> tuple[Builder, BuildRequest]:
    model_path = Path(spec["model_path"])
    if spec["builder"] == "tensorrt":
        from inferd.engine_build.pipeline import compose_tensorrt_build
        from inferd.engines.host import read_host_tuple
        from inferd.engines.locate import locate_engine

        device_id = int(spec.get("device_id", 0))
        host = read_host_tuple(precision=config.precision, device_index=device_id)
        # Named as the tensorrt runtime locates it, so the daemon can load it.
        plan = locate_engine(
            model_path, config, engine_dir=Path(spec["engine_dir"]), host=host, force=True
        )
        return compose_tensorrt_build(
            plan,
            config,
            gpu_memory_budget_bytes=int(spec["gpu_memory_budget_bytes"]),
            device_id=device_id,
            **stall_watchdog(spec),
        )
    sim = spec.get("simulation") or {}
    settings = SimSettings(
        step_s=float(sim.get("step_s", 0.002)),
        threads=int(sim.get("threads", 2)),
        fail=sim.get("fail"),
    )
    host = HostTuple(
        SIMULATED_HOST.compute_capability,
        SIMULATED_HOST.gpu_sku,
        SIMULATED_HOST.platform,
        SIMULATED_HOST.tensorrt_version,
        config.precision,
    )
    builder = SimulatedBuilder(model_path, config, host, settings=settings)
    request = BuildRequest(
        model_path=model_path,
        engine_path=Path(spec["engine_path"]),
        build_config=config,
        host=host,
        model_sha256=builder.model_sha,  # of the bytes it builds from (read once)
        **stall_watchdog(spec),
    )
    return builder, request


#: The child's ``oom_score_adj`` (-1000..1000, the kernel's): a TensorRT build is the
#: unit's largest allocation, and when memory runs out the kernel should end it, which
#: the daemon records as a failed build and serves on, rather than the serving daemon.
BUILD_OOM_SCORE_ADJ = 500


def _first_to_go_when_memory_runs_out() -> None:
    """Raise this process's ``oom_score_adj`` (raising needs no privilege; a value the
    kernel refuses, or no /proc, leaves it as inherited)."""
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as adj:
        adj.write(str(BUILD_OOM_SCORE_ADJ))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m inferd.engine_build.child SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(args[0])
    _first_to_go_when_memory_runs_out()
    # Keep the event stream on a private descriptor; fd 1 now writes to stderr.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    token = CancellationToken()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ignore_cancel = bool((spec.get("simulation") or {}).get("ignore_cancel", False))
    if not ignore_cancel:
        signal.signal(signal.SIGTERM, lambda *_: token.cancel("sigterm", "build child got SIGTERM"))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    writer = _Writer(out)
    threading.Thread(
        target=_read_commands, args=(token, ignore_cancel), name="inferd-build-stdin", daemon=True
    ).start()
    try:
        config = parse_build_config(spec["build_config"], source="build child spec")
        builder, request = _builder(spec, config)
        writer.send(EnginePathMessage(str(request.engine_path)))
        report = run_build(
            request,
            builder,
            token=token,
            record=lambda _kind, payload: writer.send(RecordMessage(dict(payload))),
            listener=writer.event,
            build_id=spec["build_id"],
            # A daemon older than the nonce (this package upgraded under it) sends
            # none and never reads one: its builds still run.
            nonce=spec.get("nonce"),
            # A daemon older than its conclusions on summaries sends none: its
            # builds' summaries are never concluded by a later daemon's start.
            concluder=spec.get("concluder"),
        )
    except Exception as exc:  # reported to the daemon as a failed build
        writer.send(ErrorMessage(f"{type(exc).__name__}: {exc}"))
        writer.close()
        return 1
    writer.send(ReportMessage(report.summary, str(report.summary_path), writer.dropped))
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
