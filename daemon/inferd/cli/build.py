"""``inferd build ONNX --config BUILD_CONFIG.json``: build (or find) a TensorRT engine
pre-flight, without a running daemon.

It runs steps 1-4 of the one engine pipeline (``inferd.engine_build.pipeline``:
locate, compile, validate, record trust), the same steps a daemon build
runs, with the same engine directory, naming, workspace rule, timing cache,
atomic write and ``.sha256`` sidecar, so the daemon later finds the engine
instead of building it in the background.  The build config is JSON::

    {"precision": "fp16", "workspace_bytes": 1073741824, "optimization_level": 3,
     "profiles": [{"input_name": "x", "min_shape": [1, 3], "opt_shape": [4, 3],
                   "max_shape": [8, 3]}]}

(every key optional; defaults as ``inferd.types.BuildConfig``; unknown keys
are an error; parsed by ``inferd.engines.build_config``, like ``build.start``'s).
The engine directory, GPU memory budget (workspace cap) and device come from
the daemon config (``--daemon-config``, else the embedded default),
``--engine-dir`` overrides the directory.  ``--manifest M`` also records the
engine's digest in deployment manifest ``M`` (created if absent), the step
that makes the daemon's gate trust it.

A build runs through ``inferd.engine_build.session.run_build`` with the TensorRT
builder: phase events, one cancellation token, the no-cancel final write,
cleanup/quarantine of partial files, the timing-cache policy and a build
summary (``<engine>.<build id>.build.json``) next to the engine.  Progress goes
to stderr: on a terminal, a live nested phase tree (``rich``); otherwise (or
without ``rich``) one plain line per phase start/finish.  stdout holds only the
result (with ``--json``, one JSON report: its last line).
``--json-log FILE`` writes every build event as a JSON line.  ``--timeout S``
cancels the build (source ``timeout``).  Ctrl-C (SIGINT) or SIGTERM cancels
cooperatively (TensorRT stops at its next step; partial files are removed);
a second Ctrl-C forces: partial files are cleaned up or quarantined and the
process exits 130 at once.  ``--calibration-data`` (INT8 calibration) runs
the same way; the calibration cache next to the engine is reused only when
trusted (``inferd.engines.calibration``) and a fresh one is written only when
the build completes.

A completed build is validated before it counts: the gate's sidecar check and
a smoke inference compared with ONNX Runtime; only then is it recorded in
``--manifest``.

Exit status: 0 built and validated, or reused; 1 the build or its validation
failed; 2 usage or environment
problem (bad build config, missing model, TensorRT/pycuda/GPU unavailable);
3 cancelled (Ctrl-C, SIGTERM, ``--timeout``); 130 forced by a second Ctrl-C.

Also runnable as ``python -m inferd.cli.build``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from inferd.engines.build_config import load_build_config
from inferd.errors import (
    CalibrationCacheError,
    ConfigError,
    EngineManifestError,
    HostTupleUnavailableError,
    InferdError,
)
from inferd.types import BuildConfig

if TYPE_CHECKING:
    from inferd.engine_build.events import BuildEvent
    from inferd.engines.locate import EnginePlan

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_FORCED = 130


class _Forced(BaseException):
    """Raised (from the SIGINT handler) by a second Ctrl-C."""


class _PlainProgress:
    """One line per phase start/finish (and cancel / outcome), indented by depth."""

    def __init__(self, stream: TextIO) -> None:
        from inferd.engine_build.events import PhaseTree

        self.stream = stream
        self.tree = PhaseTree()
        self._lock = threading.Lock()

    def _depth(self, phase_id: str | None) -> int:
        depth = 0
        node = self.tree.nodes.get(phase_id) if phase_id else None
        while node is not None and node.parent_id is not None:
            depth += 1
            node = self.tree.nodes.get(node.parent_id)
        return depth

    def __call__(self, event: BuildEvent) -> None:
        with self._lock:
            self.tree.apply(event)
            line: str | None = None
            indent = "  " * self._depth(event.phase_id)
            if event.type == "phase_start":
                line = f"start     {indent}{event.name} ({event.num_steps} steps)"
            elif event.type == "phase_finish":
                node = self.tree.nodes.get(event.phase_id or "")
                state = (
                    "" if node is None else f" [{node.status} {node.completed}/{node.num_steps}]"
                )
                line = f"finish    {indent}{event.name}{state}"
            elif event.type == "cancel_requested":
                line = f"cancel    requested by {event.detail.get('source')}"
            elif event.type == "stalled":
                line = f"stalled   {' > '.join(event.detail.get('path', []))}"
            if line is not None:
                self.stream.write(line + "\n")
                self.stream.flush()

    def close(self) -> None:
        pass


class _LiveProgress:
    """A live nested phase tree on a terminal (``rich``), refreshed from events."""

    _STYLE = {"running": "yellow", "finished": "green", "finished_early": "cyan"}

    def __init__(self, stream: TextIO, title: str) -> None:
        from rich.console import Console
        from rich.live import Live

        from inferd.engine_build.events import PhaseTree

        self.tree = PhaseTree()
        self.title = title
        self._lock = threading.Lock()
        self.live = Live(
            console=Console(file=stream),
            get_renderable=self._render,
            refresh_per_second=8,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.live.start()

    def __call__(self, event: BuildEvent) -> None:
        with self._lock:
            self.tree.apply(event)

    def _render(self) -> Any:
        from rich.text import Text
        from rich.tree import Tree

        with self._lock:
            snapshot = self.tree.snapshot()
        root = Tree(Text(f"{self.title}  [{snapshot['state']}]", style="bold"))

        def add(parent: Any, node: dict[str, Any]) -> None:
            label = Text(f"{node['name']}  ", style=self._STYLE.get(node["status"], ""))
            label.append(f"{node['completedSteps']}/{node['numSteps']}  {node['status']}")
            if node["durationMs"] is not None:
                label.append(f"  {node['durationMs'] / 1000:.1f} s", style="dim")
            branch = parent.add(label)
            for child in node["children"]:
                add(branch, child)

        for node in snapshot["roots"]:
            add(root, node)
        return root

    def close(self) -> None:
        self.live.refresh()
        self.live.stop()


def _progress(stream: TextIO, title: str) -> _PlainProgress | _LiveProgress:
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        try:
            return _LiveProgress(stream, title)
        except ImportError:
            pass
    return _PlainProgress(stream)


class _JsonLog:
    """Every build event as one JSON line (flushed per line)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self.last_seq = 0

    def __call__(self, event: BuildEvent) -> None:
        with self._lock:
            if self._file.closed:
                return
            self.last_seq = max(self.last_seq, event.seq)
            self._file.write(json.dumps(event.as_dict(), sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _listeners(sinks: list[Callable[[BuildEvent], None]]) -> Callable[[BuildEvent], None]:
    def listener(event: BuildEvent) -> None:
        for sink in sinks:
            with contextlib.suppress(Exception):
                sink(event)

    return listener


@contextlib.contextmanager
def _closing(*things: Any) -> Iterator[None]:
    try:
        yield
    finally:
        for thing in things:
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()


def _missing_tensorrt() -> str | None:
    """Why TensorRT cannot build here (its package, or pycuda for the CUDA
    context), or None."""
    try:
        import tensorrt  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a broken libnvinfer
        return f"the tensorrt package cannot be imported ({exc})"
    try:
        import pycuda.driver  # noqa: F401
    except Exception as exc:
        return f"pycuda.driver cannot be imported ({exc}); builds need it for the CUDA context"
    return None


def _forced_exit(
    engine_path: Path, build_id: str, json_log: _JsonLog | None, progress: Any, err: TextIO
) -> None:
    """Second Ctrl-C: clean up or quarantine partial files, log, exit 130 now
    (the builder thread may be inside TensorRT; it is not waited for)."""
    from inferd.engine_build.artifacts import clean_up
    from inferd.engine_build.events import BuildEvent, now_ns

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        progress.close()
    cleanup = clean_up(engine_path)
    if json_log is not None:
        mono, wall = now_ns()
        json_log(
            BuildEvent(
                build_id=build_id,
                seq=json_log.last_seq + 1,
                type="cancelled",
                phase_id=None,
                parent_id=None,
                name=None,
                step=None,
                num_steps=None,
                mono_ns=mono,
                wall_ns=wall,
                thread=threading.current_thread().name,
                cancel_state="forced",
                detail={"forced": True, "source": "sigint", "cleanup": cleanup.as_dict()},
            )
        )
        json_log.close()
    err.write(
        f"inferd build: forced by a second Ctrl-C; partial files {cleanup.status}"
        + (f" (quarantined: {cleanup.quarantined})" if cleanup.quarantined else "")
        + "\n"
    )
    err.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(EXIT_FORCED)


def _build_observed(
    onnx: Path,
    wanted: BuildConfig,
    plan: EnginePlan,
    *,
    gpu_memory_budget_bytes: int,
    device_id: int,
    timeout_s: float | None,
    stall_after_s: float | None,
    json_log_path: Path | None,
    progress_stream: TextIO,
    calibration_data: Path | None = None,
) -> dict[str, Any]:
    """Steps 2-3 of the engine pipeline (``inferd.engine_build.pipeline``) with a
    live progress display; the summary document."""
    import secrets

    from inferd.engine_build.cancel import CancellationToken, cancel_on_signals
    from inferd.engine_build.pipeline import compose_tensorrt_build
    from inferd.engine_build.session import run_build

    engine_path: Path = plan.entry.artifact_path
    builder, request = compose_tensorrt_build(
        plan,
        wanted,
        gpu_memory_budget_bytes=gpu_memory_budget_bytes,
        device_id=device_id,
        calibration_data=calibration_data,
        timeout_s=timeout_s,
        stall_after_s=stall_after_s,
    )
    build_id = secrets.token_hex(6)
    json_log = _JsonLog(json_log_path) if json_log_path is not None else None
    progress = _progress(progress_stream, f"inferd build {onnx.name} ({wanted.precision.value})")
    sinks: list[Callable[[BuildEvent], None]] = [progress]
    if json_log is not None:
        sinks.append(json_log)
    token = CancellationToken()

    def force() -> None:
        raise _Forced

    with _closing(progress, json_log):
        try:
            with cancel_on_signals(token, force=force):
                report = run_build(
                    request, builder, token=token, listener=_listeners(sinks), build_id=build_id
                )
        except _Forced:
            _forced_exit(engine_path, build_id, json_log, progress, sys.stderr)
            raise  # not reached
    return report.summary


def run(
    onnx: Path,
    build_config: Path,
    *,
    engine_dir: Path | None = None,
    model_name: str | None = None,
    daemon_config: Path | None = None,
    manifest: Path | None = None,
    calibration_data: Path | None = None,
    force: bool = False,
    as_json: bool = False,
    json_log: Path | None = None,
    timeout_s: float | None = None,
    stall_after_s: float | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Build or find the engine of ``onnx`` for ``build_config``; print what happened."""
    out = out or sys.stdout
    err = err or sys.stderr
    from dataclasses import replace

    from inferd import config as config_module
    from inferd.digest import sha256_file
    from inferd.engine_build.tensorrt_build import PRECISION_FLAGS

    try:
        if not onnx.is_file():
            raise ConfigError(f"model file {onnx} does not exist")
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"--timeout must be positive, got {timeout_s}")
        if stall_after_s is not None and stall_after_s <= 0:
            raise ConfigError(f"--stall-after must be positive, got {stall_after_s}")
        wanted = load_build_config(build_config)
        loaded = (
            config_module.load(daemon_config)
            if daemon_config is not None
            else config_module.embedded_default()
        )
        runtime_config = loaded.runtime
        if engine_dir is not None:
            runtime_config = replace(runtime_config, engine_dir=engine_dir)
    except ConfigError as exc:
        err.write(f"inferd build: {exc}\n")
        return EXIT_USAGE

    from inferd.engine_build.pipeline import record_trust, workspace_cap_bytes
    from inferd.engines.host import read_host_tuple
    from inferd.engines.locate import locate_engine
    from inferd.engines.manifest import record_in_manifest

    missing = _missing_tensorrt()
    if missing is not None:
        err.write(f"inferd build: cannot build here: {missing}\n")
        return EXIT_USAGE
    summary: dict[str, Any] | None = None
    code = EXIT_OK
    try:
        host = read_host_tuple(precision=wanted.precision, device_index=runtime_config.device_id)
        outcome = locate_engine(
            onnx,
            wanted,
            engine_dir=runtime_config.engine_dir,
            host=host,
            label=model_name,
            force=force,
        )
        if outcome.status == "to_build":
            summary = _build_observed(
                onnx,
                wanted,
                outcome,
                gpu_memory_budget_bytes=runtime_config.gpu_memory_budget_bytes,
                device_id=runtime_config.device_id,
                timeout_s=timeout_s,
                stall_after_s=stall_after_s,
                json_log_path=json_log,
                progress_stream=err,
                calibration_data=calibration_data,
            )
        engine = outcome.entry.artifact_path
        digest: str | None
        if summary is not None:
            digest = summary["baseline"]["engineSha256"]
            if summary["outcome"] == "failed":
                err.write(f"inferd build: build failed: {summary['error']}\n")
                code = EXIT_FAILED
            elif summary["outcome"] == "cancelled":
                err.write(
                    f"inferd build: cancelled ({summary['cancelReason']}); cleanup "
                    f"{summary['cleanupStatus']}, cancel latency {summary['cancelLatencyMs']} "
                    f"ms; retry: {summary['retryPolicy']} ({summary['retryReason']})\n"
                )
                code = EXIT_CANCELLED
            elif summary["validationStatus"] == "fail":
                err.write("inferd build: the built engine failed validation\n")
                code = EXIT_FAILED
        else:
            digest = sha256_file(engine)  # reused: the gate's steps 1-4 checked it
        if manifest is not None and code == EXIT_OK:
            if summary is not None:
                decision = record_trust(summary, engine, manifest=manifest)
                if not decision.trusted:
                    raise EngineManifestError(decision.note)
            else:
                record_in_manifest(manifest, engine.name, digest)
    except HostTupleUnavailableError as exc:
        err.write(f"inferd build: cannot build here: {exc}\n")
        return EXIT_USAGE
    except EngineManifestError as exc:
        err.write(f"inferd build: {exc}\n")
        return EXIT_USAGE
    except (InferdError, OSError) as exc:
        kind = "calibration cache" if isinstance(exc, CalibrationCacheError) else "build"
        err.write(f"inferd build: {kind} failed: {exc}\n")
        return EXIT_FAILED

    status = "reused" if outcome.status == "reused" else "to_build"
    build: dict[str, Any] | None = None
    if summary is not None:
        status = "built" if summary["outcome"] == "completed" else summary["outcome"]
        strongly_typed = bool(summary["baseline"]["stronglyTyped"])
        build = {
            "engine": str(engine),
            "sha256": digest,
            "duration_s": summary["baseline"]["durations"]["totalS"],
            "strongly_typed": strongly_typed,
            "precision_flags": [] if strongly_typed else list(PRECISION_FLAGS[wanted.precision]),
            "workspace_bytes": min(
                wanted.workspace_bytes,
                workspace_cap_bytes(runtime_config.gpu_memory_budget_bytes),
            ),
            "timing_cache": summary["timingCacheMode"],
            "calibration": summary["builderStats"].get("calibration"),
            "warnings": list(summary["builderStats"].get("warnings", [])),
            "build_id": summary["buildId"],
            "outcome": summary["outcome"],
            "error": summary["error"],
            "cancel_source": summary["cancelSource"],
            "cancel_latency_ms": summary["cancelLatencyMs"],
            "cleanup_latency_ms": summary["cleanupLatencyMs"],
            "cleanup_status": summary["cleanupStatus"],
            "retry_policy": summary["retryPolicy"],
            "validation_status": summary["validationStatus"],
            "summary": str(engine.parent / f"{engine.name}.{summary['buildId']}.build.json"),
        }
    report: dict[str, Any] = {
        "status": status,
        "engine": str(engine),
        "sha256": digest,
        "host": outcome.engine_name.host.describe(),
        "manifest": str(manifest) if manifest is not None and code == EXIT_OK else None,
        "quarantined": str(outcome.quarantined) if outcome.quarantined else None,
        "build": build,
    }
    if as_json:
        out.write(json.dumps(report, sort_keys=True) + "\n")
        return code
    if code != EXIT_OK:
        if build is not None:
            out.write(f"{status:<8}  {engine}\nsummary   {build['summary']}\n")
        return code
    out.write(f"{status:<8}  {engine}\n")
    out.write(f"sha256    {digest}\n")
    out.write(f"host      {outcome.engine_name.host.summary()}\n")
    if outcome.quarantined:
        out.write(f"moved     the unusable previous engine to {outcome.quarantined}\n")
    if build is not None:
        flags = ", ".join(build["precision_flags"]) or "none"
        typing = "strongly typed" if build["strongly_typed"] else f"precision flags {flags}"
        out.write(
            f"build     {build['duration_s']:.1f} s, {typing}, workspace "
            f"{build['workspace_bytes']} bytes, timing cache {build['timing_cache']}"
            + (f", calibration {build['calibration']}" if build["calibration"] else "")
            + "\n"
        )
        for warning in build["warnings"]:
            out.write(f"warning   {warning}\n")
        if "summary" in build:
            out.write(f"summary   {build['summary']}\n")
            out.write(
                f"validate  {build['validation_status']} (gate sidecar check and a smoke "
                "inference compared with ONNX Runtime)\n"
            )
    if manifest is not None:
        out.write(f"manifest  recorded in {manifest}\n")
    else:
        out.write(
            "manifest  not recorded: the daemon trusts the engine once its deployment manifest "
            f'lists it ("{engine.name}": "{digest}")\n'
        )
    return EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``inferd build`` arguments (for ``inferd.cli`` to attach to its subparser)."""
    parser.add_argument("onnx", type=Path, help="the ONNX model")
    parser.add_argument(
        "--config", dest="build_config", type=Path, required=True, help="build config (JSON)"
    )
    parser.add_argument("--engine-dir", type=Path, help="default: runtime.engine_dir")
    parser.add_argument("--model-name", help="label in the engine name (default: ONNX stem)")
    parser.add_argument(
        "--daemon-config", type=Path, help="inferd TOML config (default: the embedded one)"
    )
    parser.add_argument(
        "--manifest", type=Path, help="also record the engine in this deployment manifest"
    )
    parser.add_argument(
        "--calibration-data", type=Path, help="directory of .npz batches for INT8 calibration"
    )
    parser.add_argument("--force", action="store_true", help="build even if an engine exists")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    parser.add_argument(
        "--json-log", type=Path, metavar="FILE", help="write every build event as a JSON line"
    )
    parser.add_argument(
        "--timeout", type=float, metavar="S", help="cancel the build after S seconds (exit 3)"
    )
    parser.add_argument(
        "--stall-after",
        type=float,
        metavar="S",
        help="report a stall when no progress event came for S seconds",
    )


def run_from_args(args: argparse.Namespace) -> int:
    return run(
        args.onnx,
        args.build_config,
        engine_dir=args.engine_dir,
        model_name=args.model_name,
        daemon_config=args.daemon_config,
        manifest=args.manifest,
        calibration_data=args.calibration_data,
        force=args.force,
        as_json=args.json,
        json_log=args.json_log,
        timeout_s=args.timeout,
        stall_after_s=args.stall_after,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="inferd build", description="build a TensorRT engine pre-flight"
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
