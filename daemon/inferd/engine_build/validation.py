"""Validation after a completed build: progress is not correctness.

A completed (re)build is eligible to serve only after the gate (the sidecar
digest matches the engine) and a smoke inference whose outputs match ONNX
Runtime's reference within a precision-dependent tolerance.

The reference is computed from the model the engine is named by: its bytes are
read once and checked against that digest (``model_source.ModelSource``), and one
ONNX Runtime session is made from exactly those bytes, its external data found
beside the model (``session.model_external_initializers_file_folder_path``,
ONNX Runtime 1.21 on), which ONNX Runtime reads by path: once the session is
made, those files are checked again.  An ONNX Runtime that cannot load them from
memory (before 1.21, as JetPack 6's wheels are, a model with external data) is
given the model's path, and the files are checked again once it is loaded
(``runtime.ort_model_source.external_data_from_memory``).  A model changed
meanwhile fails validation, saying so; the engine is never compared with another
model.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferd.digest import model_digest, sha256_file
from inferd.engine_build.cancel import CancellationToken
from inferd.engine_build.model_source import ModelChangedError, ModelSource
from inferd.engines.sidecar import read_sidecar
from inferd.runtime.ort_model_source import EXTERNAL_DATA_FOLDER, external_data_from_memory
from inferd.types import BuildConfig, PrecisionMode

#: (absolute, relative) tolerance per precision.
TOLERANCES: dict[PrecisionMode, tuple[float, float]] = {
    PrecisionMode.FP32: (1e-4, 1e-3),
    PrecisionMode.FP16: (2e-2, 2e-2),
    PrecisionMode.INT8: (1e-1, 1e-1),
    PrecisionMode.MIXED: (1e-1, 1e-1),
}
#: ``cancelled``: a cancel stopped it before its verdict (the build ends cancelled).
VALIDATION_STATUSES = ("not_applicable", "pending", "pass", "fail", "cancelled")
_CPU = ["CPUExecutionProvider"]
#: How soon a signal that came just before the main thread blocked is handled.
_SIGNAL_POLL_S = 0.05

Arrays = dict[str, np.ndarray]
Infer = Callable[[Path, Arrays], Mapping[str, np.ndarray]]
#: ``run_build``'s deadline: cancels the token (source ``timeout``) once it has passed.
CheckDeadline = Callable[[], None]


@dataclass(frozen=True)
class ValidationResult:
    status: str
    gate: str
    max_abs_error: float | None
    atol: float
    rtol: float
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "gate": self.gate,
            "maxAbsError": self.max_abs_error,
            "atol": self.atol,
            "rtol": self.rtol,
            "reason": self.reason,
        }


def sidecar_gate(engine_path: Path) -> None:
    """Raises when the engine's sidecar is missing, malformed or does not match."""
    if read_sidecar(engine_path) != sha256_file(engine_path):
        raise ValueError("engine digest does not match its sidecar")


def smoke_inputs(onnx_path: Path, seed: int = 0) -> Arrays:
    """Deterministic random inputs for every model input (symbolic dims -> 1)."""
    import onnxruntime as ort

    return _smoke_inputs(ort.InferenceSession(str(onnx_path), providers=_CPU), seed)


def reference_outputs(onnx_path: Path, inputs: Arrays) -> Arrays:
    import onnxruntime as ort

    return _run(ort.InferenceSession(str(onnx_path), providers=_CPU), inputs)


def _smoke_inputs(session: Any, seed: int) -> Arrays:
    rng = np.random.default_rng(seed)
    inputs: Arrays = {}
    for spec in session.get_inputs():
        shape = [dim if isinstance(dim, int) and dim > 0 else 1 for dim in spec.shape]
        dtype = np.float16 if "float16" in spec.type else np.float32
        inputs[spec.name] = rng.standard_normal(shape).astype(dtype)
    return inputs


def _run(session: Any, inputs: Arrays, run_options: Any = None) -> Arrays:
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs, run_options), strict=True))


class ValidationCancelled(Exception):
    """A cancel came while the build's engine was validated: no verdict."""


def _stop_if_cancelled(
    token: CancellationToken | None, check_deadline: CheckDeadline | None = None
) -> None:
    if check_deadline is not None:
        check_deadline()
    if token is not None and token.is_set():
        raise ValidationCancelled


def _cancelled(
    token: CancellationToken | None, gate: str, atol: float, rtol: float
) -> ValidationResult:
    source = token.source if token is not None else None
    reason = f"cancelled ({source}) before its verdict: the engine is not kept"
    return ValidationResult("cancelled", gate, None, atol, rtol, reason)


def _run_cancellable(
    session: Any,
    inputs: Arrays,
    token: CancellationToken | None,
    check_deadline: CheckDeadline | None = None,
) -> Arrays:
    """ONNX Runtime's reference run, stopped by a cancel: ``RunOptions.terminate`` set
    from the token's listener ends the run between two nodes (ONNX Runtime raises).
    ``check_deadline`` is called at each wait: a deadline that passes during the run
    cancels the token, which stops it."""
    if token is None:
        return _run(session, inputs)
    import onnxruntime as ort

    options = ort.RunOptions()
    token.add_listener(lambda _request: setattr(options, "terminate", True))
    # after the listener: a cancel is never missed between
    _stop_if_cancelled(token, check_deadline)
    # On a thread of its own: the caller (the build's main thread) waits in ``join``,
    # where CPython runs a signal's handler (SIGTERM, SIGINT: the token's), which it
    # cannot do while that thread is inside ONNX Runtime's C++ ``run``.
    ended: list[Arrays | BaseException] = []

    def reference_run() -> None:
        try:
            ended.append(_run(session, inputs, options))
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=reference_run, name="inferd-reference-run", daemon=True)
    thread.start()
    while thread.is_alive():  # a signal just before a wait blocks is seen at the next
        thread.join(_SIGNAL_POLL_S)
        if check_deadline is not None:
            check_deadline()
    [outcome] = ended
    # The exception's traceback holds the thread's frame, which holds ``ended``, and
    # will hold this frame, which holds ``outcome``: neither may hold the exception,
    # or the session (the model's weights) lives on until a GC pass.
    ended.clear()
    if isinstance(outcome, BaseException):
        try:
            _stop_if_cancelled(token)  # ONNX Runtime's "Exiting due to terminate flag"
            raise outcome
        finally:
            del outcome
    return outcome


def reference_session(model: ModelSource) -> Any:
    """An ONNX Runtime CPU session of the model whose digest is ``model.sha256``
    (``ModelChangedError`` when the file has another); see the module's doc."""
    import onnxruntime as ort

    data, hashed = model.read()
    if hashed.external and not external_data_from_memory(ort):
        # Given bytes, an ONNX Runtime before 1.21 looks for external data beside
        # its working directory: the model is read by path, and checked after.
        del data
        session = ort.InferenceSession(str(model.path), providers=_CPU)
        model.check_unchanged(hashed)
        return session
    options = ort.SessionOptions()
    options.add_session_config_entry(EXTERNAL_DATA_FOLDER, model.directory)
    loaded = ort.InferenceSession(data, options, providers=_CPU)
    del data  # the session keeps its own reference
    if hashed.external:  # read by path
        model.check_unchanged(hashed)
    return loaded


def reference_case(
    model: ModelSource,
    seed: int = 0,
    token: CancellationToken | None = None,
    check_deadline: CheckDeadline | None = None,
) -> tuple[Arrays, Arrays]:
    """Smoke inputs and ONNX Runtime's outputs for them, from one session of the
    verified model (released before the engine under test runs); a cancel
    (``token``, or the deadline ``check_deadline`` keeps) stops it after the session
    is made or during the run (``ValidationCancelled``)."""
    session = reference_session(model)
    _stop_if_cancelled(token, check_deadline)
    inputs = _smoke_inputs(session, seed)
    return inputs, _run_cancellable(session, inputs, token, check_deadline)


def validate_build(
    engine_path: Path,
    model: ModelSource | Path,
    precision: PrecisionMode,
    infer: Infer,
    *,
    gate: Callable[[Path], None] = sidecar_gate,
    seed: int = 0,
    token: CancellationToken | None = None,
    check_deadline: CheckDeadline | None = None,
) -> ValidationResult:
    """The verdict on ``engine_path``; ``token``: a cancel stops validation between its
    steps and during ONNX Runtime's reference run (status ``cancelled``), and so does
    a deadline there (``check_deadline``, called at those points, cancels the token).
    Making the reference session and the engine's own smoke inference are not
    interruptible."""
    atol, rtol = TOLERANCES[precision]
    try:  # a deadline met while the engine was staged: neither its hash nor a session
        _stop_if_cancelled(token, check_deadline)
    except ValidationCancelled:
        return _cancelled(token, "not_run", atol, rtol)
    try:
        gate(engine_path)
    except Exception as exc:
        return ValidationResult("fail", "refused", None, atol, rtol, f"gate: {exc}")
    try:
        if not isinstance(model, ModelSource):  # the model as it is now
            model = ModelSource(model, model_digest(model).sha256)
        inputs, expected = reference_case(model, seed, token, check_deadline)
        _stop_if_cancelled(token, check_deadline)
        actual = infer(engine_path, inputs)
    except ValidationCancelled:
        return _cancelled(token, "passed", atol, rtol)
    except ModelChangedError as exc:
        return ValidationResult("fail", "passed", None, atol, rtol, str(exc))
    except Exception as exc:
        return ValidationResult("fail", "passed", None, atol, rtol, f"smoke inference: {exc}")
    worst = 0.0
    for name, want in expected.items():
        got = actual.get(name)
        if got is None or np.shape(got) != np.shape(want):
            return ValidationResult(
                "fail", "passed", None, atol, rtol, f"output {name!r} missing or mis-shaped"
            )
        want64 = np.asarray(want, dtype=np.float64)
        got64 = np.asarray(got, dtype=np.float64)
        worst = max(worst, float(np.max(np.abs(got64 - want64), initial=0.0)))
        if not np.allclose(got64, want64, atol=atol, rtol=rtol):
            return ValidationResult(
                "fail",
                "passed",
                worst,
                atol,
                rtol,
                f"output {name!r} differs from ONNX Runtime by up to {worst:.3g} "
                f"(tolerance atol={atol} rtol={rtol} for {precision.value})",
            )
    return ValidationResult(
        "pass",
        "passed",
        worst,
        atol,
        rtol,
        f"matches ONNX Runtime within {precision.value} tolerance",
    )


def eligible_to_serve(summary: Mapping[str, Any]) -> bool:
    """Only a completed build whose validation passed may be adopted for serving."""
    return summary.get("outcome") == "completed" and summary.get("validationStatus") == "pass"


def tensorrt_smoke_infer(
    trt: Any,
    cuda: Any,
    model_path: Path,
    config: BuildConfig,
    device_id: int,
    model_sha256: str | None = None,
) -> Infer:
    """Validation's smoke inference for a TensorRT build: load the new engine into
    a ``TensorRTRuntime`` in this process (its own CUDA context) and run it.  The
    runtime's gate wants the engine in a manifest; a temporary one lists just this
    engine's digest (the sidecar gate has already checked it), so validating
    trusts nothing else.  ``model_sha256``: the digest the engine is named by (the
    gate's name step checks it; None: the model's digest at load)."""

    def infer(engine_path: Path, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from inferd.config import RuntimeConfig
        from inferd.digest import sha256_file
        from inferd.engines.manifest import record_in_manifest
        from inferd.runtime.tensorrt import LABEL, TensorRTRuntime
        from inferd.types import EngineCacheEntry, ThermalState

        with tempfile.TemporaryDirectory(prefix="inferd-validate-") as tmp:
            manifest = Path(tmp) / "manifest.json"
            record_in_manifest(manifest, engine_path.name, sha256_file(engine_path))
            runtime = TensorRTRuntime(
                RuntimeConfig(
                    engine_dir=engine_path.parent, engine_manifest=manifest, device_id=device_id
                ),
                trt=trt,
                cuda=cuda,
                alert=lambda _alert: None,
                record=lambda _kind, _payload: None,
                thermal=ThermalState,
            )
            try:
                digest = model_sha256 or model_digest(model_path).sha256
                entry = EngineCacheEntry(LABEL, engine_path, model_path, digest, config)
                handle = runtime.deserialize_engine(entry)
                try:
                    return runtime.infer(handle, inputs)
                finally:
                    runtime.release_engine(handle)
            finally:
                runtime.close()

    return infer
