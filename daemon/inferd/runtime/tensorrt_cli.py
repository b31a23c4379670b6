"""``inferd build ONNX --config BUILD_CONFIG.json``: build (or find) a TensorRT engine
pre-flight, without a running daemon.

It runs exactly what the daemon's ``tensorrt`` runtime runs in
``compile_engine`` (same engine directory, naming, build options, timing
cache, atomic write and ``.sha256`` sidecar), so the daemon later finds the
engine instead of building it in the air.  The build config is JSON::

    {"precision": "fp16", "workspace_bytes": 1073741824, "optimization_level": 3,
     "profiles": [{"input_name": "x", "min_shape": [1, 3], "opt_shape": [4, 3],
                   "max_shape": [8, 3]}]}

(every key optional; defaults as ``inferd.types.BuildConfig``; unknown keys
are an error).  The engine directory, GPU memory budget (workspace cap) and
device come from the daemon config (``--daemon-config``, else the embedded
default), ``--engine-dir`` overrides the directory.  ``--manifest M`` also
records the engine's digest in deployment manifest ``M`` (created if absent),
the step that makes the daemon's gate trust it.

Exit status: 0 built or reused; 1 the build failed; 2 usage or environment
problem (bad build config, missing model, TensorRT/pycuda/GPU unavailable).

Also runnable as ``python -m inferd.runtime.tensorrt_cli``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from inferd.errors import (
    CalibrationCacheError,
    ConfigError,
    EngineManifestError,
    HostTupleUnavailableError,
    InferdError,
    RuntimeNotAvailableError,
)
from inferd.types import BuildConfig, OptimizationProfile, PrecisionMode, ThermalState

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_BUILD_KEYS = frozenset({"precision", "workspace_bytes", "optimization_level", "profiles"})
_PROFILE_KEYS = frozenset({"input_name", "min_shape", "opt_shape", "max_shape"})


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) for dim in value
    ):
        raise ConfigError(f"{where} must be a list of integers, got {value!r}")
    return tuple(value)


def build_config_from_mapping(data: Mapping[str, Any], *, source: str) -> BuildConfig:
    """A ``BuildConfig`` from parsed JSON; ``ConfigError`` naming the key otherwise."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the build config must be a JSON object")
    unknown = sorted(set(data) - _BUILD_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; known: {sorted(_BUILD_KEYS)}")
    defaults = BuildConfig()
    precision_text = data.get("precision", defaults.precision.value)
    try:
        precision = PrecisionMode(precision_text)
    except ValueError:
        raise ConfigError(
            f"{source}: precision {precision_text!r} is not one of "
            f"{[mode.value for mode in PrecisionMode]}"
        ) from None
    numbers: dict[str, int] = {}
    for key in ("workspace_bytes", "optimization_level"):
        value = data.get(key, getattr(defaults, key))
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
        numbers[key] = value
    raw_profiles = data.get("profiles", [])
    if not isinstance(raw_profiles, list):
        raise ConfigError(f"{source}: profiles must be a list")
    profiles: list[OptimizationProfile] = []
    for index, item in enumerate(raw_profiles):
        where = f"{source}: profiles[{index}]"
        if not isinstance(item, Mapping) or set(item) != _PROFILE_KEYS:
            raise ConfigError(f"{where} must have exactly the keys {sorted(_PROFILE_KEYS)}")
        if not isinstance(item["input_name"], str) or not item["input_name"]:
            raise ConfigError(f"{where}.input_name must be a non-empty string")
        try:
            profiles.append(
                OptimizationProfile(
                    input_name=item["input_name"],
                    min_shape=_shape(item["min_shape"], f"{where}.min_shape"),
                    opt_shape=_shape(item["opt_shape"], f"{where}.opt_shape"),
                    max_shape=_shape(item["max_shape"], f"{where}.max_shape"),
                )
            )
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    try:
        return BuildConfig(precision=precision, profiles=tuple(profiles), **numbers)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_build_config(path: Path) -> BuildConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read build config {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    return build_config_from_mapping(data, source=str(path))


def _record_in_manifest(manifest: Path, engine: Path, sha256: str) -> None:
    from inferd.engines.manifest import Manifest, write_manifest

    entries = Manifest.load(manifest).entries() if manifest.exists() else {}
    entries[engine.name] = sha256
    manifest.parent.mkdir(parents=True, exist_ok=True)
    write_manifest(manifest, entries)


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
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Build or find the engine of ``onnx`` for ``build_config``; print what happened."""
    out = out or sys.stdout
    err = err or sys.stderr
    from dataclasses import replace

    from inferd import config as config_module
    from inferd.digest import sha256_file

    try:
        if not onnx.is_file():
            raise ConfigError(f"model file {onnx} does not exist")
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

    from inferd.runtime import tensorrt

    try:
        runtime = tensorrt.create(
            runtime_config,
            is_fallback=False,
            alert=lambda _alert: None,
            record=lambda _kind, _payload: None,
            thermal=ThermalState.unavailable,
        )
    except RuntimeNotAvailableError as exc:
        err.write(f"inferd build: cannot build here: {exc}\n")
        return EXIT_USAGE
    try:
        if calibration_data is not None:
            runtime.build_hooks.calibration_data = calibration_data
        outcome = runtime.build(onnx, wanted, label=model_name, force=force)
        engine = outcome.entry.artifact_path
        digest = outcome.result.sha256 if outcome.result else sha256_file(engine)
        if manifest is not None:
            _record_in_manifest(manifest, engine, digest)
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
    finally:
        runtime.close()

    report: dict[str, Any] = {
        "status": outcome.status,
        "engine": str(engine),
        "sha256": digest,
        "host": outcome.engine_name.host.describe(),
        "manifest": str(manifest) if manifest is not None else None,
        "quarantined": str(outcome.quarantined) if outcome.quarantined else None,
        "build": outcome.result.as_dict() if outcome.result else None,
    }
    if as_json:
        out.write(json.dumps(report, sort_keys=True) + "\n")
        return EXIT_OK
    out.write(f"{outcome.status:<8}  {engine}\n")
    out.write(f"sha256    {digest}\n")
    out.write(f"host      {outcome.engine_name.host.summary()}\n")
    if outcome.quarantined:
        out.write(f"moved     the unusable previous engine to {outcome.quarantined}\n")
    if outcome.result is not None:
        result = outcome.result
        flags = ", ".join(result.precision_flags) or "none"
        typing = "strongly typed" if result.strongly_typed else f"precision flags {flags}"
        out.write(
            f"build     {result.duration_s:.1f} s, {typing}, workspace "
            f"{result.workspace_bytes} bytes, timing cache {result.timing_cache}"
            + (f", calibration {result.calibration}" if result.calibration else "")
            + "\n"
        )
        for warning in result.warnings:
            out.write(f"warning   {warning}\n")
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
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="inferd build", description="build a TensorRT engine pre-flight"
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
