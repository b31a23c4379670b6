"""The inferd error family.  Every runtime failure is an ``InferdError``."""

from __future__ import annotations

import errno
from collections.abc import Mapping

from inferd_wire.protocol import Code, ProtocolError


class InferdError(Exception):
    """Root of every error a component raises while serving."""


class EngineBuildError(InferdError):
    pass


class EngineDeserializeError(InferdError):
    pass


class EngineMissingError(InferdError):
    """No engine for this model and host is in the engine dir.  The ``tensorrt``
    runtime never builds one itself: the model serves on the fallback while the
    daemon builds ``engine_path`` in a build child (DESIGN.md, "One engine pipeline")."""

    def __init__(self, message: str, *, engine_path: object = None) -> None:
        super().__init__(message)
        self.engine_path = engine_path


class EngineHashMismatchError(InferdError):
    """An engine's content does not match a trusted digest.  ``stage`` says which:
    ``"sidecar"`` (its ``.sha256`` sidecar), ``"manifest"`` (the deployment
    manifest, including "not listed") or ``"reread"`` (the file changed after the
    gate passed it)."""

    def __init__(self, message: str, *, stage: str = "") -> None:
        super().__init__(message)
        self.stage = stage


class EngineSchemaMismatchError(InferdError):
    """An engine file name does not follow the naming schema (``expected``/``got``
    empty), or names a build tuple other than this host's (``expected`` is the
    host's fields, ``got`` the engine's, both as display strings)."""

    def __init__(
        self,
        reason: str,
        *,
        expected: Mapping[str, str] | None = None,
        got: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.expected: dict[str, str] = dict(expected or {})
        self.got: dict[str, str] = dict(got or {})


class EngineSidecarMissingError(InferdError):
    pass


class EngineManifestError(InferdError):
    """The deployment manifest cannot be read or is malformed (a missing entry is
    ``EngineHashMismatchError(stage="manifest")`` instead)."""


class HostTupleUnavailableError(InferdError):
    """This host's GPU / platform / TensorRT tuple cannot be read (no NVML and no
    pycuda, TensorRT not importable, unparseable ``/etc/nv_tegra_release``).

    An ``InferdError`` rather than ``RuntimeNotAvailableError``: it surfaces when
    the TensorRT path prepares an engine, where the service already turns any
    ``InferdError`` into failover to ``onnx_trt_ep``.  ``causes`` maps each part
    that failed (``gpu``, ``platform``, ``tensorrt``) to why."""

    def __init__(self, message: str, *, causes: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.causes: dict[str, str] = dict(causes or {})


class CalibrationCacheError(InferdError):
    pass


class CalibrationDataError(EngineBuildError):
    """An INT8 calibration data set does not fit the network (a batch that names
    other inputs, or holds another dtype or shape than TensorRT will read), or
    cannot be read.  Raised before the build starts; the message names the file,
    the input, what the network expects and what the file holds."""


class UnsafeDirectoryError(InferdError):
    """A directory the daemon would create files or sockets in is not safely its own
    (another owner, writable by others, a symlink): ``inferd.owned_files``."""


class UncheckedDirectoryError(UnsafeDirectoryError):
    """A directory the daemon would create files or sockets in, or read its own files
    from (the engine dir), could not be made or checked for a reason of this process
    or system, not of the directory: out of descriptors (``EMFILE``, ``ENFILE``),
    memory or space, an I/O error (its own, or a directory's above it).  It is not
    used, as an unsafe one is not (so every caller that handles an unsafe directory
    handles this), but the message names the errno and not the directory's owner
    or mode, and ``inferd run`` exits 1, so systemd restarts it: what made the
    failure may be gone by then; the engine dir is checked again at the model's
    next location.  ``errno`` is the OS error number."""

    def __init__(self, message: str, *, errno_code: int) -> None:
        super().__init__(message)
        self.errno = errno_code


class UncheckedEngineError(UncheckedDirectoryError):
    """An engine file, its digest sidecar, or the engine dir's listing of engines that
    could not be read or examined for a reason of this process or system, not of the
    file: out of descriptors or memory, a stale handle (``EMFILE``, ``ENFILE``,
    ``ENOMEM``, ``ESTALE``...; ``engines.sidecar.ABOUT_THE_FILE`` sorts: an ``EIO``
    is the file's).  No verdict: the gate neither passes nor refuses it (no
    ``engine_refused``), location moves nothing aside and plans no build (the engine
    may be intact), and no build is asked for (its name is not in
    ``serving.slot.BUILD_FIXES``); the next location reads it again.  A kind of
    ``UncheckedDirectoryError``, so that every caller that handles one (not used this
    time, ``ERRNO=``, exit 1) handles this the same way."""


class ProcessLimitError(InferdError):
    """A limit of the process or of the kernel is below what the config's bounds let
    clients make the daemon hold: the daemon does not start (``inferd run`` exits 2,
    as for a config error: a restart would meet the same limit).  The message names
    the limit, the count and what to change; ``errno_code`` is the error the limit
    would have made a client's connection or region meet (systemd's ``ERRNO=``)."""

    errno_code = 0

    def __init__(self, message: str, *, limit: int, needed: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.needed = needed


class OpenFilesLimitError(ProcessLimitError):
    """The process's limit on open descriptors (``RLIMIT_NOFILE``) is below what the
    config's bounds let clients make the daemon hold (``supervision.open_files``):
    clients within every bound could then make libzmq abort it."""

    errno_code = errno.EMFILE


class MapCountLimitError(ProcessLimitError):
    """The kernel's limit on a process's mappings (``vm.max_map_count``) leaves too
    little room for the regions the shm bounds let clients register and what the
    daemon maps itself (``supervision.map_count``): clients within every bound could
    then make the daemon's own ``mmap`` (a thread, malloc, CUDA) fail."""

    errno_code = errno.ENOMEM


class InferenceError(InferdError):
    pass


class ExecutionFailedError(InferenceError):
    """TensorRT or CUDA failed to run an inference the engine had accepted
    (``execute_async_v3`` returned False, a CUDA error in a copy or at
    synchronize): the engine's or the GPU's fault, not the request's.  Counted
    towards failing the model over while serving (DESIGN.md entry 48).
    ``sticky``: a CUDA error that poisons the context (an illegal address, a
    launch failure): every later call in that context fails the same way."""

    def __init__(self, message: str, *, sticky: bool = False) -> None:
        super().__init__(message)
        self.sticky = sticky


class OutOfMemoryError(InferdError):
    pass


class OutputShapeError(InferenceError):
    """An output the request placed in a shared-memory region came out of the model
    with another shape than the request gave it (a dynamic dimension): the request's
    fault, answered INVALID_ARGUMENT; nothing was written past the range."""


class TelemetryUnavailableError(InferdError):
    pass


class RuntimeNotAvailableError(Exception):
    """A runtime strategy cannot be composed here (disabled, or its library is
    missing).  Raised at composition time, hence outside ``InferdError``."""

    def __init__(self, label: str, reason: str) -> None:
        super().__init__(f"runtime {label!r} is not available: {reason}")
        self.label = label
        self.reason = reason


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the rule."""


class ModelBuildRunningError(ProtocolError):
    """``build.start`` refused ``FAILED_PRECONDITION``: build ``build_id`` of the model
    runs (one build per model at once).  A background rebuild waits for its end."""

    def __init__(self, build_id: str, model: str) -> None:
        super().__init__(
            Code.FAILED_PRECONDITION,
            f"build {build_id} of model {model!r} is still running; "
            "cancel it or wait for it to finish",
        )
        self.build_id = build_id
