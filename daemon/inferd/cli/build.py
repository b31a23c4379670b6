"""``inferd build ONNX [--config inferd.toml] [--build-config BUILD.json]``: build
(or find) a TensorRT engine pre-flight, without a running daemon.

It runs steps 1-4 of the one engine pipeline (``inferd.engine_build.pipeline``:
locate, compile, validate, record trust), the same steps a daemon build
runs, with the same engine directory, naming, workspace rule, timing cache,
atomic write and ``.sha256`` sidecar, so the daemon later finds the engine
instead of building it in the background.  The build config is the model's in
the daemon config (``--config``, the daemon's TOML as in every command), or
JSON given with ``--build-config`` (``schemas/build/config.json``)::

    {"precision": "fp16", "workspace_bytes": 1073741824, "optimization_level": 3,
     "profiles": [{"input_name": "x", "min_shape": [1, 3], "opt_shape": [4, 3],
                   "max_shape": [8, 3]}]}

(every key optional: for a model the daemon config serves, a key it lacks is the
model's, as for ``build.start``, else ``inferd.types.BuildConfig``'s default;
unknown keys are an error; parsed by ``inferd.engines.build_config``).
The engine directory, GPU memory budget (workspace cap) and device come from
the daemon config (``--config``, else the embedded default), ``--engine-dir``
overrides the directory.  ``--manifest M`` also records the engine's digest in
deployment manifest ``M`` (created if absent), the step that makes the daemon's gate trust it.

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

A completed build is validated before it counts: the gate's sidecar check and a smoke
inference compared with ONNX Runtime, on the engine staged under ``<engine dir>/staging/``;
only an engine that passed is committed to its final path (so a later run reuses only
validated engines) and recorded in ``--manifest``; one that failed is quarantined.

Exit status: 0 built and validated, or reused; 1 the build or its validation failed;
2 usage or environment problem (bad build config, missing model, TensorRT/pycuda/GPU
unavailable); 3 cancelled (Ctrl-C, SIGTERM, ``--timeout``); 130 forced by a second Ctrl-C.
Also runnable as ``python -m inferd.cli.build``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from inferd.cli.build_progress import BuildProgress
from inferd.cli.build_report import report_outcome
from inferd.config.ceilings import MAX_BUILD_DURATION_S
from inferd.engines.build_config import load_build_config
from inferd.errors import (
    CalibrationCacheError,
    ConfigError,
    EngineManifestError,
    HostTupleUnavailableError,
    InferdError,
)
from inferd.owned_files import apply_owned_umask
from inferd.process_start import prepare_process
from inferd.types import BuildConfig
from inferd_client.cli_format import printable

if TYPE_CHECKING:
    from inferd.config import ModelConfig
    from inferd.engines.locate import EnginePlan

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_FORCED = 130
#: How long a forced exit waits for the display to show what is queued.
_FORCED_RENDER_S = 1.0


class _Forced(BaseException):
    """Raised (from the SIGINT handler) by a second Ctrl-C."""


def _error(err: TextIO, text: str) -> None:
    """One ``inferd build:`` line on stderr, escaped: an exception's text quotes paths,
    TensorRT's messages and names from the ONNX file (``printable``, DESIGN.md 252)."""
    err.write(printable(f"inferd build: {text}") + "\n")


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


def _forced_exit(engine_path: Path, build_id: str, progress: BuildProgress, err: TextIO) -> None:
    """Second Ctrl-C: clean up or quarantine partial files, log, exit 130 now
    (the builder thread may be inside TensorRT; it is not waited for)."""
    from inferd.engine_build.artifacts import clean_up
    from inferd.engine_build.events import BuildEvent, now_ns

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    progress.stop_rendering(timeout=_FORCED_RENDER_S)
    with contextlib.suppress(Exception):
        progress.display.close()
    json_log = progress.json_log
    cleanup = clean_up(engine_path)  # another live build's files: its own
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
    _error(
        err,
        f"forced by a second Ctrl-C; partial files {cleanup.status}"
        + (f" (quarantined: {cleanup.quarantined})" if cleanup.quarantined else "")
        + (f" (left to a live build: {cleanup.left})" if cleanup.left else ""),
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
) -> tuple[dict[str, Any], int]:
    """Steps 2-3 of the engine pipeline (``inferd.engine_build.pipeline``) with a
    live progress display; the summary document and the step events not shown."""
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
    title = f"inferd build {onnx.name} ({wanted.precision.value})"
    progress = BuildProgress(progress_stream, title, json_log_path)
    token = CancellationToken()

    def force() -> None:
        raise _Forced

    try:
        with cancel_on_signals(token, force=force):
            report = run_build(request, builder, token=token, listener=progress, build_id=build_id)
    except _Forced:
        _forced_exit(engine_path, build_id, progress, sys.stderr)
        raise  # not reached
    finally:
        progress.close()
    if progress.dropped:
        progress_stream.write(
            f"inferd build: {progress.dropped} step events not shown (the display or"
            " --json-log fell behind; the build summary has every phase)\n"
        )
    return report.summary, progress.dropped


def _build_config_for(
    onnx: Path, path: Path | None, models: tuple[ModelConfig, ...]
) -> BuildConfig:
    """``path``'s build config (``--build-config``), or without one the model's own
    (precision and profiles of the daemon config's ``[[models]]`` entry serving
    ``onnx``; the defaults when it serves none).  For a model the daemon config
    serves, the keys ``path`` lacks come from the model, as for ``build.start``
    (``build_args.parse_build_config_arg``), so one document names one engine
    either way; its profiles come from ``[[models.profiles]]`` (the one source of a
    model's profiles): a build config with others is refused, since the daemon
    would never find (or could not serve) that engine."""
    served = [model for model in models if model.path.resolve() == onnx.resolve()]
    if path is None:
        return served[0].build_config() if served else BuildConfig()
    if not served:
        return load_build_config(path)
    model = served[0]
    wanted = load_build_config(path, defaults=model.build_config())
    for other in served:
        if wanted.profiles != other.profiles:
            raise ConfigError(
                f"{path}: profiles differ from models[{other.name!r}].profiles of the daemon "
                f"config, which serves {onnx}; leave them out of the build config (they are "
                "taken from the daemon config) or change them there"
            )
    return wanted


def run(
    onnx: Path,
    build_config: Path | None = None,
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

    from inferd.config import embedded_default
    from inferd.config import load as load_config
    from inferd.digest import sha256_file
    from inferd.engines.locate import locate_engine, model_file_problem

    try:
        if (problem := model_file_problem(onnx)) is not None:  # a FIFO: named, not read
            raise ConfigError(f"model file {onnx} {problem}")
        for flag, seconds in (("--timeout", timeout_s), ("--stall-after", stall_after_s)):
            # NaN passed "<= 0" (a NaN timeout cancelled at once); inf or 1e300 killed the
            # timer's thread (OverflowError) and the build ran without a timeout
            if seconds is not None and not 0 < seconds <= MAX_BUILD_DURATION_S:
                limit = f"at most {MAX_BUILD_DURATION_S:g} s"
                raise ConfigError(f"{flag} must be more than 0 and {limit}, got {seconds}")
        loaded = load_config(daemon_config) if daemon_config is not None else embedded_default()
        wanted = _build_config_for(onnx, build_config, loaded.models)
        runtime_config = loaded.runtime
        if engine_dir is not None:
            runtime_config = replace(runtime_config, engine_dir=engine_dir)
    except ConfigError as exc:
        _error(err, str(exc))
        return EXIT_USAGE

    from inferd.engine_build.pipeline import record_trust
    from inferd.engines.host import read_host_tuple
    from inferd.engines.manifest import record_in_manifest

    if (missing := _missing_tensorrt()) is not None:
        _error(err, f"cannot build here: {missing}")
        return EXIT_USAGE
    summary: dict[str, Any] | None = None
    not_shown = 0
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
            summary, not_shown = _build_observed(
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
                _error(err, f"build failed: {summary['error']}")
                code = EXIT_FAILED
            elif summary["outcome"] == "cancelled":
                _error(
                    err,
                    f"cancelled ({summary['cancelReason']}); cleanup {summary['cleanupStatus']}, "
                    f"cancel latency {summary['cancelLatencyMs']} ms; retry: "
                    f"{summary['retryPolicy']} ({summary['retryReason']})",
                )
                code = EXIT_CANCELLED
            elif summary["validationStatus"] == "fail":
                validation = summary["validation"] or {}
                moved = validation.get("quarantinedTo")
                kept = f"quarantined to {moved}" if moved else "removed"
                _error(
                    err,
                    f"the built engine failed validation ({validation.get('reason')}); "
                    f"it was not kept at {engine.name}: {kept}",
                )
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
    except (HostTupleUnavailableError, EngineManifestError) as exc:
        here = isinstance(exc, HostTupleUnavailableError)
        _error(err, f"cannot build here: {exc}" if here else str(exc))
        return EXIT_USAGE
    except (InferdError, OSError) as exc:
        kind = "calibration cache" if isinstance(exc, CalibrationCacheError) else "build"
        _error(err, f"{kind} failed: {exc}")
        return EXIT_FAILED

    return report_outcome(
        outcome,
        summary,
        digest,
        code,
        succeeded=code == EXIT_OK,
        wanted=wanted,
        manifest=manifest,
        not_shown=not_shown,
        as_json=as_json,
        out=out,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``inferd build`` arguments (for ``inferd.cli`` to attach to its subparser)."""
    parser.add_argument("onnx", type=Path, help="the ONNX model")
    parser.add_argument(
        "--build-config",
        type=Path,
        metavar="FILE",
        help="build config JSON (schemas/build/config.json; example: "
        "schemas/build/config.example.json); default: the model's own in --config",
    )
    parser.add_argument(
        "--config",
        dest="daemon_config",
        type=Path,
        metavar="FILE",
        help="the daemon's TOML config: engine dir, GPU budget, device, the model's "
        "precision and profiles (default: the embedded one)",
    )
    parser.add_argument("--engine-dir", type=Path, help="default: runtime.engine_dir")
    parser.add_argument("--model-name", help="label in the engine name (default: ONNX stem)")
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
    prepare_process()  # as `inferd build` (inferd.cli.main): a closed fd 0-2 on /dev/null
    parser = argparse.ArgumentParser(
        prog="inferd build", description="build a TensorRT engine pre-flight"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    apply_owned_umask()  # as `inferd build` does (inferd.cli.main)
    from inferd.supervision.logging import log_to_stderr

    log_to_stderr()
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
