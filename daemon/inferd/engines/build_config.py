"""The one parser of build configurations (``inferd build --build-config``, the
daemon's ``build.start``, the build child's spec) and its inverse; and the one
workspace rule of every TensorRT build.

``parse_build_config`` takes parsed JSON/msgpack (a mapping, every key
optional) and returns a ``BuildConfig``, raising ``ConfigError`` that names the
key; ``build_config_to_mapping`` is the same document back, so a config crosses
a process boundary without a second set of rules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inferd.errors import ConfigError
from inferd.types import BuildConfig, OptimizationProfile, PrecisionMode

#: The workspace rule, one for every TensorRT build (``TensorRTBuilder`` for the
#: daemon's ``build.start``, its background rebuilds, ``inferd build`` and
#: ``inferd acceptance``; ONNX Runtime's TensorRT EP, ``trt_max_workspace_size``):
#: at most a quarter of the GPU memory budget, so a build running beside resident
#: engines cannot starve them.
WORKSPACE_BUDGET_FRACTION = 4

BUILD_CONFIG_KEYS = frozenset({"precision", "workspace_bytes", "optimization_level", "profiles"})
PROFILE_KEYS = frozenset({"input_name", "min_shape", "opt_shape", "max_shape"})


def workspace_cap_bytes(gpu_memory_budget_bytes: int) -> int:
    return gpu_memory_budget_bytes // WORKSPACE_BUDGET_FRACTION


def build_workspace_bytes(build_config: BuildConfig, gpu_memory_budget_bytes: int) -> int:
    """The workspace a build gets: what it asks for, capped by the budget's share."""
    return min(build_config.workspace_bytes, workspace_cap_bytes(gpu_memory_budget_bytes))


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) for dim in value
    ):
        raise ConfigError(f"{where} must be a list of integers, got {value!r}")
    return tuple(value)


def _profile(item: object, where: str) -> OptimizationProfile:
    if not isinstance(item, Mapping) or set(item) != PROFILE_KEYS:
        raise ConfigError(f"{where} must have exactly the keys {sorted(PROFILE_KEYS)}")
    if not isinstance(item["input_name"], str) or not item["input_name"]:
        raise ConfigError(f"{where}.input_name must be a non-empty string")
    try:
        return OptimizationProfile(
            input_name=item["input_name"],
            min_shape=_shape(item["min_shape"], f"{where}.min_shape"),
            opt_shape=_shape(item["opt_shape"], f"{where}.opt_shape"),
            max_shape=_shape(item["max_shape"], f"{where}.max_shape"),
        )
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_build_config(
    data: object, *, source: str, defaults: BuildConfig | None = None
) -> BuildConfig:
    """A ``BuildConfig`` from ``data``; keys it lacks come from ``defaults``."""
    base = defaults if defaults is not None else BuildConfig()
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: the build config must be a map (JSON object)")
    unknown = sorted(set(data) - BUILD_CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; known: {sorted(BUILD_CONFIG_KEYS)}")
    precision_text = data.get("precision", base.precision.value)
    try:
        precision = PrecisionMode(precision_text)
    except ValueError:
        raise ConfigError(
            f"{source}: precision {precision_text!r} is not one of "
            f"{[mode.value for mode in PrecisionMode]}"
        ) from None
    numbers: dict[str, int] = {}
    for key in ("workspace_bytes", "optimization_level"):
        value = data.get(key, getattr(base, key))
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
        numbers[key] = value
    if "profiles" in data:
        raw_profiles = data["profiles"]
        if not isinstance(raw_profiles, list | tuple):
            raise ConfigError(f"{source}: profiles must be a list")
        profiles = tuple(
            _profile(item, f"{source}: profiles[{index}]")
            for index, item in enumerate(raw_profiles)
        )
    else:
        profiles = base.profiles
    try:
        return BuildConfig(precision=precision, profiles=profiles, **numbers)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def build_config_to_mapping(config: BuildConfig) -> dict[str, Any]:
    """The document ``parse_build_config`` reads back into an equal ``BuildConfig``."""
    return {
        "precision": config.precision.value,
        "workspace_bytes": config.workspace_bytes,
        "optimization_level": config.optimization_level,
        "profiles": [
            {
                "input_name": profile.input_name,
                "min_shape": list(profile.min_shape),
                "opt_shape": list(profile.opt_shape),
                "max_shape": list(profile.max_shape),
            }
            for profile in config.profiles
        ],
    }


def _is_dynamic(dim: int | None) -> bool:
    return dim is None or dim < 0


def check_profiles(
    inputs: Mapping[str, Sequence[int | None]], profiles: Sequence[OptimizationProfile]
) -> dict[str, OptimizationProfile]:
    """``profiles`` by input name, checked against a model's ``inputs`` (name ->
    shape; ``None`` or ``-1`` is a dynamic dimension): each names an input, once,
    with its rank, and leaves its static dimensions as they are.  Raises
    ``ValueError`` with a sentence naming the input (the caller adds where it came
    from), so a mistake is never a TensorRT assertion or a silently ignored option.
    Used by the TensorRT builder and by ``onnx_trt_ep`` before it loads a model."""
    seen: dict[str, OptimizationProfile] = {}
    for profile in profiles:
        name = profile.input_name
        if name not in inputs:
            raise ValueError(
                f"there is a profile for {name!r}, but the model's inputs are {sorted(inputs)}"
            )
        if name in seen:
            raise ValueError(f"there are two profiles for {name!r}")
        shape = list(inputs[name])
        if len(profile.min_shape) != len(shape):
            raise ValueError(
                f"the profile for {name!r} has rank {len(profile.min_shape)}, the input "
                f"{shape} has rank {len(shape)}"
            )
        for axis, dim in enumerate(shape):
            if not _is_dynamic(dim) and not (
                profile.min_shape[axis] == profile.opt_shape[axis] == profile.max_shape[axis] == dim
            ):
                raise ValueError(
                    f"the profile for {name!r} varies axis {axis}, which the model fixes at "
                    f"{dim} (input shape {shape})"
                )
        seen[name] = profile
    return seen


def unprofiled_dynamic_inputs(
    inputs: Mapping[str, Sequence[int | None]], profiles: Sequence[OptimizationProfile]
) -> dict[str, list[int | None]]:
    """The inputs with a dynamic dimension that no profile covers (name -> shape)."""
    covered = {profile.input_name for profile in profiles}
    return {
        name: list(shape)
        for name, shape in sorted(inputs.items())
        if name not in covered and any(_is_dynamic(dim) for dim in shape)
    }


def load_build_config(path: Path, *, defaults: BuildConfig | None = None) -> BuildConfig:
    """A build config JSON file; keys it lacks come from ``defaults``."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read build config {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    return parse_build_config(data, source=str(path), defaults=defaults)
