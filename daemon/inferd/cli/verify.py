"""``inferd verify ENGINE [--manifest M] [--json]``: run the engine gate and print every step.

Exit status: 0 when all five steps pass (the daemon would load the engine on
this host), 1 when a step fails (the first failure is where the daemon
refuses), 2 on a usage problem (no such engine file, or one whose path cannot
be examined; unreadable or malformed manifest) or when this host's tuple cannot
be read; in that last case the steps that do not need it still run and print,
so a ground station without a GPU can check names, sidecars and manifests.

Without ``--manifest`` step 5 fails: the daemon trusts only engines that its
deployment manifest lists.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from inferd.engines.gate import STEPS, StepVerdict, explain, first_failure
from inferd.engines.host import read_host_tuple
from inferd.engines.manifest import Manifest
from inferd.engines.naming import parse_engine_name
from inferd.errors import (
    EngineManifestError,
    EngineSchemaMismatchError,
    HostTupleUnavailableError,
)
from inferd.types import HostTuple, PrecisionMode

EXIT_TRUSTED = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2

_LABELS = {"pass": "PASS", "fail": "FAIL", "skipped": "SKIP"}


def _precision_for(engine: Path, precision: PrecisionMode | None) -> PrecisionMode:
    """The precision to compare against: the caller's, else the one the name encodes
    (verify checks the hardware/software tuple; the daemon passes its configured one)."""
    if precision is not None:
        return precision
    try:
        return parse_engine_name(engine.name).precision
    except EngineSchemaMismatchError:
        return PrecisionMode.FP32  # step 2 is skipped anyway when the name does not parse


def _human(
    engine: Path,
    host: HostTuple | None,
    host_error: str | None,
    manifest: Manifest,
    verdicts: list[StepVerdict],
    out: TextIO,
) -> None:
    out.write(f"engine    {engine}\n")
    out.write(f"host      {host.summary() if host else f'unavailable: {host_error}'}\n")
    out.write(f"manifest  {manifest.source}\n")
    width = max(len(step) for step in STEPS)
    for verdict in verdicts:
        label = _LABELS[verdict.verdict]
        out.write(f"{verdict.number}. {verdict.step:<{width}}  {label}  {verdict.message}\n")


def _conclusion(verdicts: list[StepVerdict], host: HostTuple | None) -> tuple[int, str]:
    failure = first_failure(verdicts)
    if failure is not None:
        return EXIT_REFUSED, f"REFUSED at step {failure.number} ({failure.step})"
    if host is None:
        return EXIT_USAGE, "NOT DECIDED: this host's tuple is unavailable (step 2 not run)"
    if len(verdicts) == len(STEPS) and all(verdict.passed for verdict in verdicts):
        return EXIT_TRUSTED, "TRUSTED: all five steps pass"
    return EXIT_REFUSED, "REFUSED: not every step passed"  # pragma: no cover - defensive


def run(
    engine: Path,
    manifest: Path | None,
    as_json: bool,
    host: HostTuple | None = None,
    *,
    precision: PrecisionMode | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    read_host: Callable[..., HostTuple] = read_host_tuple,
) -> int:
    """Print each step's verdict for ``engine``; return the exit status (0 / 1 / 2).

    ``host`` defaults to this host's tuple (``read_host_tuple``) with the
    precision the engine name encodes unless ``precision`` is given."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    engine = Path(engine)
    try:
        exists = engine.exists()
    except OSError as exc:  # pathlib swallows ENOENT, not EACCES or ENAMETOOLONG
        err.write(f"inferd verify: {engine}: cannot be examined ({exc.strerror})\n")
        return EXIT_USAGE
    if not exists:
        err.write(f"inferd verify: {engine}: no such engine file\n")
        return EXIT_USAGE
    try:
        trusted = (
            Manifest.load(manifest, follow=True)  # an operator's file, as the daemon reads it
            if manifest is not None
            else Manifest.empty("<none: pass --manifest>")
        )
    except EngineManifestError as exc:
        err.write(f"inferd verify: {exc}\n")
        return EXIT_USAGE

    host_error: str | None = None
    if host is None:
        try:
            host = read_host(precision=_precision_for(engine, precision))
        except HostTupleUnavailableError as exc:
            host_error = str(exc)

    verdicts = explain(engine, host=host, manifest=trusted, host_error=host_error)
    code, conclusion = _conclusion(verdicts, host)
    if as_json:
        document: dict[str, Any] = {
            "engine": str(engine),
            "host": host.describe() if host else None,
            "host_error": host_error,
            "manifest": trusted.source,
            "steps": [verdict.as_dict() for verdict in verdicts],
            "trusted": code == EXIT_TRUSTED,
            "exit_code": code,
            "conclusion": conclusion,
        }
        out.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
    else:
        _human(engine, host, host_error, trusted, verdicts, out)
        out.write(conclusion + "\n")
    return code
