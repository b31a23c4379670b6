"""The engine trust gate: five checks, always in this order, before TensorRT reads a byte.

====  ===================  ==================================================================
step  name                 refuses with
====  ===================  ==================================================================
1     ``schema_parse``     ``EngineSchemaMismatchError(reason)``: the file name does not
                           follow ``inferd.engines.naming``
2     ``host_match``       ``EngineSchemaMismatchError(reason, expected=host, got=engine)``:
                           built for another GPU / platform / TensorRT / precision (or,
                           when the caller says, another model or build config)
3     ``sidecar_present``  ``EngineSidecarMissingError``: no ``<engine>.sha256``
4     ``sidecar_digest``   ``EngineHashMismatchError(stage="sidecar")``: the file's SHA-256
                           (streamed) differs from the sidecar, or the sidecar is malformed,
                           or the file cannot be read (a symlink, or not a regular file)
5     ``manifest_digest``  ``EngineHashMismatchError(stage="manifest")``: the deployment
                           manifest does not list the engine, or lists another digest
====  ===================  ==================================================================

``validate`` stops at the first failing step (so an engine failing several
refuses at the lowest), logs ``engine_refused`` (step, reason) and writes a
``engine_refused`` FDR record, then raises.  The load's one read of a validated
engine (``ValidatedEngine.read_verified``, ``inferd.engines.validated``) is the
last check, ``reread``: the bytes handed on hashed again, refused the same way.
``steps`` / ``explain`` run every step that can run and return each verdict
(``pass``, ``fail``, ``skipped`` with a message) without logging or recording: that is what
``inferd verify`` prints.  The first ``fail`` of ``steps`` is always the step
``validate`` refuses at.

A file the gate could not read or examine for a reason not about it (``EMFILE``,
``ENOMEM``: ``sidecar.ABOUT_THE_FILE`` sorts the errno; an ``EIO`` is the file's) gets
no verdict:
``validate`` and ``explain(raise_unchecked=True)`` (location) raise
``UncheckedEngineError`` from the step that met it, logging and recording nothing;
``steps`` / ``explain`` show it as that step's ``fail``, naming the errno.

The gate never writes: it opens files read-only, never through a symlink unless
``follow=True`` (a staged engine, an operator's file: DESIGN.md 125), and creates nothing.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog

from inferd.digest import sha256_and_stat
from inferd.engines.manifest import Manifest
from inferd.engines.naming import EngineName, build_config_hash, parse_engine_name
from inferd.engines.sidecar import about_the_file, read_sidecar, sidecar_path, unchecked_engine
from inferd.engines.validated import STEP_REREAD, RefusalHook
from inferd.engines.validated import ValidatedEngine as ValidatedEngine  # re-exported
from inferd.errors import (
    EngineHashMismatchError,
    EngineSchemaMismatchError,
    EngineSidecarMissingError,
    InferdError,
    UncheckedEngineError,
)
from inferd.types import BuildConfig, HostTuple, RecordSink

STEP_SCHEMA_PARSE = "schema_parse"
STEP_HOST_MATCH = "host_match"
STEP_SIDECAR_PRESENT = "sidecar_present"
STEP_SIDECAR_DIGEST = "sidecar_digest"
STEP_MANIFEST_DIGEST = "manifest_digest"
STEPS: tuple[str, ...] = (
    STEP_SCHEMA_PARSE,
    STEP_HOST_MATCH,
    STEP_SIDECAR_PRESENT,
    STEP_SIDECAR_DIGEST,
    STEP_MANIFEST_DIGEST,
)
RECORD_KIND = "engine_refused"
_NOT_FOLLOWED = "is a symbolic link, which inferd does not follow in its own directories"

Verdict = Literal["pass", "fail", "skipped"]


@dataclass(frozen=True)
class StepVerdict:
    number: int
    step: str
    verdict: Verdict
    message: str
    error: InferdError | None = field(default=None, compare=False, repr=False)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def as_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "number": self.number,
            "step": self.step,
            "verdict": self.verdict,
            "message": self.message,
        }
        if self.error is not None:
            document["error"] = type(self.error).__name__
        if isinstance(self.error, EngineSchemaMismatchError) and self.error.expected:
            document["expected"] = self.error.expected
            document["got"] = self.error.got
        return document


def first_failure(verdicts: list[StepVerdict]) -> StepVerdict | None:
    return next((verdict for verdict in verdicts if verdict.verdict == "fail"), None)


class _Skip(Exception):
    pass


class _Evaluation:
    """One pass over the five steps for one path; each expensive input computed once."""

    def __init__(
        self,
        path: Path,
        *,
        host: HostTuple | None,
        host_error: str | None,
        manifest: Manifest,
        model_sha256: str | None,
        build_config: BuildConfig | None,
        follow: bool = False,
    ) -> None:
        self.path = path
        self.follow = follow
        self.host = host
        self.host_error = host_error
        self.manifest = manifest
        self.model_sha256 = model_sha256.lower() if model_sha256 is not None else None
        self.config_hash = build_config_hash(build_config) if build_config is not None else None
        self.name: EngineName | None = None
        self.has_sidecar = False
        self._digest: str | None = None
        self._stat: os.stat_result | None = None
        self._read_error: str | None = None
        self._unchecked: UncheckedEngineError | None = None

    # -- inputs -------------------------------------------------------------------------

    def file_digest(self) -> str | None:
        """The engine's SHA-256 (streamed) and, from the same descriptor, its ``fstat``;
        None with ``read_error`` set when the file cannot be read; ``UncheckedEngineError``
        (again at each call) when that is not about the file."""
        if self._unchecked is not None:
            raise self._unchecked
        if self._digest is None and self._read_error is None:
            try:
                self._digest, self._stat = sha256_and_stat(self.path, follow=self.follow)
            except OSError as exc:
                if not about_the_file(exc):
                    self._unchecked = unchecked_engine(f"engine {self.path}", "read", exc)
                    raise self._unchecked from exc
                self._read_error = str(exc) or type(exc).__name__
        return self._digest

    # -- the five steps: each returns its pass message or raises ------------------------

    def schema_parse(self) -> str:
        self.name = parse_engine_name(self.path.name)
        return f"the name follows the schema: {self.name.summary()}"

    def host_match(self) -> str:
        if self.name is None:
            raise _Skip("needs a name that parses (step 1)")
        if self.host is None:
            raise _Skip(f"this host's tuple is unavailable: {self.host_error or 'unknown'}")
        expected = self.host.describe()
        got = self.name.host.describe()
        if self.model_sha256 is not None:
            expected["model_sha256"] = self.model_sha256[: len(self.name.model_sha256_prefix)]
            got["model_sha256"] = self.name.model_sha256_prefix
        if self.config_hash is not None:
            expected["build_config"] = self.config_hash
            got["build_config"] = self.name.build_config_hash
        differ = [key for key in expected if expected[key] != got[key]]
        if differ:
            details = "; ".join(
                f"{key} {got[key]} (engine) vs {expected[key]} (expected)" for key in differ
            )
            raise EngineSchemaMismatchError(
                f"engine {self.path.name!r} was built for another host tuple: {details}",
                expected=expected,
                got=got,
            )
        return f"built for this host: {self.host.summary()}"

    def sidecar_present(self) -> str:
        sidecar = sidecar_path(self.path)
        try:
            mode = os.stat(sidecar, follow_symlinks=self.follow).st_mode
        except (FileNotFoundError, NotADirectoryError):
            raise EngineSidecarMissingError(
                f"engine {self.path.name!r} has no digest sidecar {sidecar.name!r}: the gate "
                "trusts only engines with one"
            ) from None
        except OSError as exc:
            if not about_the_file(exc):  # EMFILE, ENOMEM: no verdict
                raise unchecked_engine(f"digest sidecar {sidecar}", "examined", exc) from exc
            raise EngineSidecarMissingError(
                f"digest sidecar {sidecar} cannot be examined: {exc}"
            ) from exc
        if stat.S_ISLNK(mode):
            raise EngineSidecarMissingError(f"digest sidecar {sidecar} {_NOT_FOLLOWED}")
        if not stat.S_ISREG(mode):
            raise EngineSidecarMissingError(f"digest sidecar {sidecar} is not a regular file")
        self.has_sidecar = True
        return f"digest sidecar {sidecar.name!r} is present"

    def sidecar_digest(self) -> str:
        if not self.has_sidecar:
            raise _Skip("needs the digest sidecar (step 3)")
        try:
            expected = read_sidecar(self.path, follow=self.follow, raise_unchecked=True)
        except EngineSidecarMissingError as exc:  # removed since step 3
            raise EngineHashMismatchError(str(exc), stage="sidecar") from exc
        actual = self.file_digest()
        if actual is None:
            raise EngineHashMismatchError(
                f"engine {self.path.name!r} cannot be read to check its digest: {self._read_error}",
                stage="sidecar",
            )
        if actual != expected:
            raise EngineHashMismatchError(
                f"engine {self.path.name!r} does not match its digest sidecar: the file's "
                f"sha256 is {actual}, the sidecar says {expected}",
                stage="sidecar",
            )
        return f"the file's sha256 {actual} matches the sidecar"

    def manifest_digest(self) -> str:
        trusted = self.manifest.lookup(self.path)
        actual = self.file_digest()
        if actual is None:
            raise EngineHashMismatchError(
                f"engine {self.path.name!r} cannot be read to check it against the deployment "
                f"manifest: {self._read_error}",
                stage="manifest",
            )
        if actual != trusted:
            raise EngineHashMismatchError(
                f"engine {self.path.name!r} is not the one the deployment manifest "
                f"{self.manifest.source} trusts: the file's sha256 is {actual}, the manifest "
                f"says {trusted}",
                stage="manifest",
            )
        return f"listed in the deployment manifest {self.manifest.source} with this sha256"

    # -- running ------------------------------------------------------------------------

    def run(self, *, stop_at_first_failure: bool, raise_unchecked: bool) -> list[StepVerdict]:
        """Each step's verdict; ``raise_unchecked``: a step that could not read its file
        raises ``UncheckedEngineError`` (no verdict), else it is that step's ``fail``."""
        checks = {
            STEP_SCHEMA_PARSE: self.schema_parse,
            STEP_HOST_MATCH: self.host_match,
            STEP_SIDECAR_PRESENT: self.sidecar_present,
            STEP_SIDECAR_DIGEST: self.sidecar_digest,
            STEP_MANIFEST_DIGEST: self.manifest_digest,
        }
        verdicts: list[StepVerdict] = []
        for number, step in enumerate(STEPS, start=1):
            try:
                message = checks[step]()
            except _Skip as skip:
                verdicts.append(StepVerdict(number, step, "skipped", str(skip)))
                continue
            except InferdError as exc:
                if raise_unchecked and isinstance(exc, UncheckedEngineError):
                    raise
                verdicts.append(StepVerdict(number, step, "fail", str(exc), exc))
                if stop_at_first_failure:
                    break
                continue
            verdicts.append(StepVerdict(number, step, "pass", message))
        return verdicts

    def validated(self, refused: RefusalHook) -> ValidatedEngine:
        assert self.name is not None and self._digest is not None and self._stat is not None
        return ValidatedEngine(
            path=self.path,
            name=self.name,
            sha256=self._digest,
            size_bytes=self._stat.st_size,
            mtime_ns=self._stat.st_mtime_ns,
            inode=self._stat.st_ino,
            device=self._stat.st_dev,
            manifest_source=self.manifest.source,
            follow=self.follow,
            refused=refused,
        )


def explain(
    path: Path,
    *,
    host: HostTuple | None,
    manifest: Manifest,
    host_error: str | None = None,
    model_sha256: str | None = None,
    build_config: BuildConfig | None = None,
    raise_unchecked: bool = False,
) -> list[StepVerdict]:
    """Every step's verdict for ``path``.  With ``host=None`` (no GPU or TensorRT
    here, e.g. a ground station) step 2 is ``skipped`` with ``host_error``.
    ``raise_unchecked`` (location): a file that could not be read for a reason not
    about it raises ``UncheckedEngineError`` instead of failing its step."""
    evaluation = _Evaluation(
        Path(path),
        host=host,
        host_error=host_error,
        manifest=manifest,
        model_sha256=model_sha256,
        build_config=build_config,
    )
    return evaluation.run(stop_at_first_failure=False, raise_unchecked=raise_unchecked)


class EngineGate:
    """Validates engine files for one host tuple against one deployment manifest."""

    def __init__(
        self,
        host: HostTuple,
        manifest: Manifest,
        *,
        record: RecordSink | None = None,
        log: Any = None,
    ) -> None:
        self.host = host
        self.manifest = manifest
        self._record = record
        self._log = log if log is not None else structlog.get_logger("inferd.engines.gate")

    def validate(
        self,
        path: Path,
        *,
        model_sha256: str | None = None,
        build_config: BuildConfig | None = None,
        follow: bool = False,
    ) -> ValidatedEngine:
        """The validated engine, or the first step's refusal (logged and recorded);
        ``UncheckedEngineError`` (neither) when a file could not be read for a reason
        not about it.

        ``model_sha256`` / ``build_config``, when given, are checked in step 2
        against the model hash and build-config hash the name encodes."""
        evaluation = _Evaluation(
            Path(path),
            host=self.host,
            host_error=None,
            manifest=self.manifest,
            model_sha256=model_sha256,
            build_config=build_config,
            follow=follow,
        )
        verdicts = evaluation.run(stop_at_first_failure=True, raise_unchecked=True)
        refusal = first_failure(verdicts)
        if refusal is not None:
            assert refusal.error is not None
            self._refused(Path(path), refusal.number, refusal.step, refusal.message, refusal.error)
            raise refusal.error

        def reread_refused(step: str, reason: str) -> None:  # ``read_verified``'s refusal
            error = EngineHashMismatchError(reason, stage=STEP_REREAD)
            self._refused(Path(path), len(STEPS) + 1, step, reason, error)

        validated = evaluation.validated(reread_refused)
        self._log.info(
            "engine_validated",
            engine=str(path),
            sha256=validated.sha256,
            manifest=self.manifest.source,
        )
        return validated

    def steps(
        self,
        path: Path,
        *,
        model_sha256: str | None = None,
        build_config: BuildConfig | None = None,
    ) -> list[StepVerdict]:
        """Every step's verdict (for ``inferd verify``); neither logs nor records."""
        return explain(
            path,
            host=self.host,
            manifest=self.manifest,
            model_sha256=model_sha256,
            build_config=build_config,
        )

    explain = steps

    def _refused(self, path: Path, number: int, step: str, reason: str, error: Exception) -> None:
        self._log.warning(
            "engine_refused",
            engine=str(path),
            step=step,
            step_number=number,
            reason=reason,
            error=type(error).__name__,
        )
        if self._record is None:
            return
        try:
            self._record(RECORD_KIND, {"engine": str(path), "step": step, "reason": reason})
        except Exception as exc:  # the refusal must surface even if recording fails
            self._log.error("engine_refused_record_failed", engine=str(path), error=str(exc))
