"""The arguments of the build control ops, checked (``supervisor.BuildManager``).

Each parser raises the ``ProtocolError`` the control socket answers with, in the
order a client meets them; nothing here starts, finds or changes a build.
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from inferd.config import BuildsConfig, ModelConfig
from inferd.config.security import STALL_AFTER_RULE, stall_after_ok
from inferd.engine_build.retention import next_build_number
from inferd.engines.build_config import build_config_to_mapping, parse_build_config
from inferd.engines.locate import model_file_problem
from inferd.errors import ConfigError
from inferd_wire.protocol import MAX_REQUESTED_BY_CHARS, Code, ProtocolError, require_text

BUILDERS = ("auto", "simulated")
CONTROL_SOURCES = ("control", "ide")
_SIM_KEYS = {"step_s", "ignore_cancel", "fail"}
_MAX_FAIL_CHARS = 256
#: ``build.start``'s optional arguments with a default when absent, never null.
_NOT_NULL = ("build_config", "simulation", "timeout_s", "stall_after_s")

log = structlog.get_logger("inferd.builds")


class BuildCounter:
    """The numbers of the daemon's build ids (``b<N>-<6 hex>``), from 1 + the highest
    on disk (``retention.next_build_number``): a later build has a higher number
    across restarts, which orders builds where file times cannot (a wall clock at
    1970 or set back).  A count that could not list a directory (``EMFILE`` at
    start) is taken again at each next build until one succeeds, never trusted:
    a count from 1 would have made the newest build the oldest, the first the caps
    remove.  Called under the build manager's lock."""

    def __init__(self, build_dir: Path, engine_dir: Path) -> None:
        self._directories = (build_dir, engine_dir)
        self._next = 1
        self._counted = False
        self._count()

    def __next__(self) -> int:
        if not self._counted:
            self._count()
        number, self._next = self._next, self._next + 1
        return number

    def _count(self) -> None:
        try:
            found = next_build_number(*self._directories)
        except OSError as exc:
            log.warning(
                "build_counter_unchecked",
                error=f"{type(exc).__name__}: {exc}",
                next_number=self._next,
                reason="a builds or engine directory could not be listed; counted again "
                "at the next build, which is numbered after this run's builds only",
            )
            return
        self._next, self._counted = max(self._next, found), True


def tensorrt_importable() -> bool:
    """Whether a build child can import TensorRT, without importing it here."""
    if sys.modules.get("tensorrt") is not None:  # already imported (e.g. by a runtime)
        return True
    try:
        return importlib.util.find_spec("tensorrt") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class StartArgs:
    """``build.start``'s arguments: ``builder`` is resolved (tensorrt | simulated)."""

    model: str
    config: ModelConfig
    build_config: dict[str, Any]
    requested_by: str
    builder: str
    simulation: dict[str, Any] | None
    #: Seconds the build may run: ``timeout_s``, else ``builds.max_duration_s``.
    deadline_s: float
    #: Its child's stall watchdog: ``stall_after_s``, else ``builds.stall_after_s``
    #: (0: none).
    stall_after_s: float


def parse_start(
    header: Mapping[str, Any],
    models: Mapping[str, ModelConfig],
    tensorrt_available: Callable[[], bool],
    max_duration_s: float,
    stall_after_s: float = 0.0,
) -> StartArgs:
    """``build.start {model, build_config?, builder?, simulation?, requested_by?,
    timeout_s?, stall_after_s?}`` (``max_duration_s``, ``stall_after_s``: the
    ``[builds]`` keys, which apply when the header has none)."""
    for key in _NOT_NULL:  # null is not absent: the schema types each (227)
        if key in header and header[key] is None:
            raise ProtocolError(
                Code.INVALID_ARGUMENT, f"'{key}' is null: leave it out for its default"
            )
    model = header.get("model")
    if not isinstance(model, str):
        raise ProtocolError(Code.INVALID_ARGUMENT, "'model' must be a string")
    config = models.get(model)
    if config is None:
        raise ProtocolError(
            Code.NOT_FOUND, f"no model named {model!r}; configured: {sorted(models)}"
        )
    build_config = parse_build_config_arg(header.get("build_config"), config)
    # Free text recorded as sent (FDR, journal, build.status): printable only.
    requested_by = require_text(
        header.get("requested_by", "operator"), "requested_by", MAX_REQUESTED_BY_CHARS
    )
    choice = header.get("builder", "auto")
    if choice not in BUILDERS:
        raise ProtocolError(Code.INVALID_ARGUMENT, f"'builder' must be one of {BUILDERS}")
    builder = "tensorrt" if choice == "auto" and tensorrt_available() else "simulated"
    simulation = header.get("simulation")
    if simulation is not None:
        if builder != "simulated" or not isinstance(simulation, dict):
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                "'simulation' (test knobs) is a map and only applies to the simulated builder",
            )
        unknown = set(simulation) - _SIM_KEYS
        if unknown:
            raise ProtocolError(Code.INVALID_ARGUMENT, f"unknown simulation keys {sorted(unknown)}")
        step_s = simulation.get("step_s", 0.002)
        if (
            not isinstance(step_s, int | float)
            or isinstance(step_s, bool)
            or not (0 <= step_s <= 10)
        ):
            raise ProtocolError(Code.INVALID_ARGUMENT, "'simulation.step_s' must be 0..10")
        if not isinstance(simulation.get("ignore_cancel", False), bool):
            raise ProtocolError(Code.INVALID_ARGUMENT, "'simulation.ignore_cancel' must be a bool")
        if "fail" in simulation:  # absent: the build succeeds; null is not absent
            # The simulated builder's error: build.status, the build event, the FDR.
            require_text(simulation["fail"], "simulation.fail", _MAX_FAIL_CHARS)
    deadline_s = parse_timeout(header.get("timeout_s"), max_duration_s)
    stall_after_s = parse_stall_after(header.get("stall_after_s"), stall_after_s)
    problem = model_file_problem(config.path)  # a FIFO is named, never waited on
    if problem is not None:
        raise ProtocolError(
            Code.FAILED_PRECONDITION, f"model file {config.path} of {model!r} {problem}"
        )
    return StartArgs(
        model, config, build_config, requested_by, builder, simulation, deadline_s, stall_after_s
    )


def parse_timeout(raw: object, max_duration_s: float) -> float:
    """``build.start``'s ``timeout_s``: it may only shorten ``builds.max_duration_s``
    (the operator's bound on every build), which applies when it is absent."""
    if raw is None:
        return max_duration_s
    rule = (
        f"a number of seconds more than 0 and at most {max_duration_s:g} "
        "(builds.max_duration_s, which it may only shorten)"
    )
    return _seconds(raw, "timeout_s", lambda s: 0 < s <= max_duration_s, rule)


def parse_stall_after(raw: object, configured: float) -> float:
    """``build.start``'s ``stall_after_s``: this build's stall watchdog, by the rule of
    ``builds.stall_after_s`` (``configured``, which applies when it is absent)."""
    if raw is None:
        return configured
    rule = f"{STALL_AFTER_RULE} (as builds.stall_after_s)"
    return _seconds(raw, "stall_after_s", stall_after_ok, rule)


def _seconds(raw: object, key: str, ok: Callable[[float], bool], rule: str) -> float:
    """``raw`` as seconds when it is a number ``ok`` takes (NaN and inf fail any
    comparison), else ``INVALID_ARGUMENT`` naming ``key`` and ``rule``."""
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        if ok(raw):
            return float(raw)
        got = repr(raw)
    else:  # not echoed: it may be any msgpack value, of any size
        got = f"a {type(raw).__name__}"
    raise ProtocolError(Code.INVALID_ARGUMENT, f"'{key}' must be {rule}, got {got}")


def child_spec(
    build_id: str,
    args: StartArgs,
    engine_path: Path,
    engine_dir: Path,
    gpu: Mapping[str, int],
    limits: BuildsConfig,
) -> dict[str, Any]:
    """What the build child ``build_id`` of ``args`` is started with
    (``inferd.engine_build.child``), its stall watchdog included: a child reads a spec
    without ``stall_after_s`` (an older daemon's) as no watchdog."""
    return {
        "build_id": build_id,
        "nonce": secrets.token_hex(16),  # its records' (``Build.nonce``)
        "builder": args.builder,
        "model_path": str(args.config.path),
        "engine_path": str(engine_path),
        "engine_dir": str(engine_dir),
        **gpu,
        "simulation": args.simulation,
        "build_config": args.build_config,
        "stall_after_s": args.stall_after_s,
        "stall_cancels_after": limits.stall_cancels_after,
    }


def parse_build_config_arg(raw: object, model: ModelConfig) -> dict[str, Any]:
    """``build_config`` over the model's defaults (``ModelConfig.build_config``), as the
    mapping the child is given.  Profiles come from the model config only: an engine
    built with others would be one the model cannot serve at its own shapes."""
    defaults = model.build_config()
    if raw is None:
        return build_config_to_mapping(defaults)
    try:
        config = parse_build_config(raw, source="build_config", defaults=defaults)
    except ConfigError as exc:
        raise ProtocolError(Code.INVALID_ARGUMENT, str(exc)) from None
    if config.profiles != defaults.profiles:
        raise ProtocolError(
            Code.INVALID_ARGUMENT,
            f"build_config.profiles differ from models[{model.name!r}].profiles in the "
            "daemon config, the one source of a model's profiles; change them there "
            "(and restart) or leave them out of build.start",
        )
    return build_config_to_mapping(config)


#: ``build.cancel``'s ``reason``: a sentence, not a document.
MAX_CANCEL_REASON_CHARS = 256


def parse_cancel(header: Mapping[str, Any]) -> tuple[str, str]:
    """``build.cancel``'s ``(source, reason)`` (the build itself is looked up first)."""
    source = header.get("source", "control")
    if source not in CONTROL_SOURCES:
        raise ProtocolError(Code.INVALID_ARGUMENT, f"'source' must be one of {CONTROL_SOURCES}")
    # Recorded in the FDR, the build event and build.status, and written to the
    # child's pipe on the bus thread: printable only.
    reason = require_text(
        header.get("reason", f"build.cancel from {source}"), "reason", MAX_CANCEL_REASON_CHARS
    )
    return str(source), reason
