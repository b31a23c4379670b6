"""Engine file naming schema: what an engine was built from and for, in its name.

A serialized TensorRT engine only works with the TensorRT version, GPU and
platform it was built on, for the precision and build options it was built
with.  Its file name says all of that, so the gate can refuse a foreign engine
before TensorRT ever reads it::

    <label>_m<model16>_cc<major>.<minor>-<sku>_<platform>_trt<version>_<precision>_b<config12>.engine

    demo_m3f2a9b1c4d5e6f70_cc8.7-orin_r36.4.0_trt10.3.0.30_fp16_b1a2b3c4d5e6f.engine

=============  ======================================================================
field          value
=============  ======================================================================
``label``      a human hint (model name): ``[a-z0-9]`` words joined by ``-``, at most
               48 characters (``sanitize_label`` makes one).  Not compared.
``m<model16>`` the first 16 hex digits of the ONNX model's digest (64 bits: an
               identity, not the integrity check; sidecar and manifest do that):
               its file's SHA-256, or with external data files one over them too
               (``inferd.digest``).
``cc…-<sku>``  CUDA compute capability ``major.minor`` (``cc8.7``; ``cc10.0`` is not
               ``cc1.00``) and the GPU name sanitized by ``sanitize_sku``
               (``NVIDIA GeForce RTX 4090`` -> ``geforce-rtx-4090``).
platform       L4T release from ``/etc/nv_tegra_release`` (``r36.4.0``), ``none`` off
               Jetson.
``trt…``       the full ``tensorrt.__version__`` (``trt10.3.0.30``), kept verbatim.
precision      ``inferd.types.PrecisionMode`` value: ``fp32``, ``fp16``, ``int8``,
               ``mixed``.
``b<config12>`` the first 12 hex digits of ``build_config_hash(BuildConfig)``: SHA-256
               of the config's canonical JSON (sorted keys, enums as values).
=============  ======================================================================

Why this shape: ``_`` separates fields and occurs in no field, so splitting is
unambiguous; fields are ``[a-z0-9.-]`` only (safe on every file system, in
URLs and in shells, and no case-folding surprises); each field is keyed by a
fixed prefix or a closed vocabulary, so an operator can read a name; and
integers are written without leading zeros, so ``format_engine_name`` and
``parse_engine_name`` are exact inverses: every string that parses formats back
to itself (property-tested).  A name that does not parse raises
``EngineSchemaMismatchError`` with a sentence saying which field is wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from inferd.errors import EngineSchemaMismatchError
from inferd.types import (
    GPU_SKU_MAX_CHARS,
    BuildConfig,
    HostTuple,
    PrecisionMode,
)

ENGINE_SUFFIX = ".engine"
FIELD_SEPARATOR = "_"
MODEL_HASH_CHARS = 16
BUILD_CONFIG_HASH_CHARS = 12
LABEL_MAX_CHARS = 48
#: Linux NAME_MAX; the field limits keep every valid name well below it.
NAME_MAX_BYTES = 255

SCHEMA = (
    "<label>_m<model16>_cc<major>.<minor>-<sku>_<platform>_trt<version>_<precision>"
    "_b<config12>.engine"
)

_WORDS = r"[a-z0-9]+(?:-[a-z0-9]+)*"
_INT = r"(?:0|[1-9][0-9]?)"
_LABEL = re.compile(_WORDS)
_MODEL = re.compile(rf"m([0-9a-f]{{{MODEL_HASH_CHARS}}})")
_GPU = re.compile(rf"cc({_INT})\.({_INT})-(.+)")
_TRT = re.compile(r"trt(.+)")
_CONFIG = re.compile(rf"b([0-9a-f]{{{BUILD_CONFIG_HASH_CHARS}}})")
_HEX64 = re.compile(r"[0-9a-f]{64}")

_FIELDS = ("label", "model", "gpu", "platform", "tensorrt", "precision", "build config")


@dataclass(frozen=True)
class EngineName:
    """A parsed engine file name.  ``host`` is the tuple the engine was built for."""

    label: str
    model_sha256_prefix: str
    host: HostTuple
    build_config_hash: str

    def __post_init__(self) -> None:
        if not _LABEL.fullmatch(self.label) or len(self.label) > LABEL_MAX_CHARS:
            raise ValueError(
                f"label {self.label!r} must be 1..{LABEL_MAX_CHARS} lowercase letters and digits "
                "in '-'-separated words (see sanitize_label)"
            )
        if not re.fullmatch(rf"[0-9a-f]{{{MODEL_HASH_CHARS}}}", self.model_sha256_prefix):
            raise ValueError(
                f"model hash prefix {self.model_sha256_prefix!r} must be "
                f"{MODEL_HASH_CHARS} lowercase hex digits"
            )
        if not re.fullmatch(rf"[0-9a-f]{{{BUILD_CONFIG_HASH_CHARS}}}", self.build_config_hash):
            raise ValueError(
                f"build config hash {self.build_config_hash!r} must be "
                f"{BUILD_CONFIG_HASH_CHARS} lowercase hex digits"
            )

    @property
    def precision(self) -> PrecisionMode:
        return self.host.precision

    def format(self) -> str:
        return format_engine_name(self)

    def matches_model(self, model_sha256: str) -> bool:
        """True when ``model_sha256`` (full digest or a prefix of at least 16) is this model."""
        digest = model_sha256.lower()
        return len(digest) >= MODEL_HASH_CHARS and digest[:MODEL_HASH_CHARS] == (
            self.model_sha256_prefix
        )

    def describe(self) -> dict[str, str]:
        return {
            "label": self.label,
            "model_sha256": self.model_sha256_prefix,
            **self.host.describe(),
            "build_config": self.build_config_hash,
        }

    def summary(self) -> str:
        return (
            f"{self.label}: model {self.model_sha256_prefix}, {self.host.summary()}, "
            f"build config {self.build_config_hash}"
        )


def format_engine_name(name: EngineName) -> str:
    host = name.host
    fields = (
        name.label,
        f"m{name.model_sha256_prefix}",
        f"cc{host.compute_capability[0]}.{host.compute_capability[1]}-{host.gpu_sku}",
        host.platform,
        f"trt{host.tensorrt_version}",
        host.precision.value,
        f"b{name.build_config_hash}",
    )
    return FIELD_SEPARATOR.join(fields) + ENGINE_SUFFIX


def _refuse(filename: str, reason: str) -> EngineSchemaMismatchError:
    return EngineSchemaMismatchError(
        f"engine file name {filename!r} does not follow the naming schema: {reason} "
        f"(expected {SCHEMA})"
    )


def parse_engine_name(filename: str) -> EngineName:
    """The ``EngineName`` a file name (not a path) encodes, or ``EngineSchemaMismatchError``."""
    if not isinstance(filename, str):
        raise EngineSchemaMismatchError(f"engine file name must be a string, got {filename!r}")
    if "/" in filename or "\x00" in filename:
        raise _refuse(filename, "it is a path, not a file name")
    if len(filename.encode("utf-8", "surrogateescape")) > NAME_MAX_BYTES:
        raise _refuse(filename, f"it is longer than {NAME_MAX_BYTES} bytes")
    if not filename.endswith(ENGINE_SUFFIX):
        raise _refuse(filename, f"it does not end in {ENGINE_SUFFIX!r}")
    fields = filename[: -len(ENGINE_SUFFIX)].split(FIELD_SEPARATOR)
    if len(fields) != len(_FIELDS):
        raise _refuse(
            filename,
            f"it has {len(fields)} '{FIELD_SEPARATOR}'-separated field(s), the schema has "
            f"{len(_FIELDS)}",
        )
    label, model, gpu, platform, trt, precision, config = fields

    def bad(index: int, text: str, rule: str) -> EngineSchemaMismatchError:
        return _refuse(filename, f"field {index + 1} ({_FIELDS[index]}) {text!r} {rule}")

    if not _LABEL.fullmatch(label) or len(label) > LABEL_MAX_CHARS:
        raise bad(0, label, f"is not 1..{LABEL_MAX_CHARS} of [a-z0-9] in '-'-separated words")
    model_match = _MODEL.fullmatch(model)
    if model_match is None:
        raise bad(1, model, f"is not 'm' + {MODEL_HASH_CHARS} lowercase hex digits")
    gpu_match = _GPU.fullmatch(gpu)
    if gpu_match is None:
        raise bad(2, gpu, "is not 'cc<major>.<minor>-<sku>' (integers without leading zeros)")
    trt_match = _TRT.fullmatch(trt)
    if trt_match is None:
        raise bad(4, trt, "does not start with 'trt'")
    try:
        mode = PrecisionMode(precision)
    except ValueError:
        raise bad(
            5, precision, f"is not one of {', '.join(m.value for m in PrecisionMode)}"
        ) from None
    config_match = _CONFIG.fullmatch(config)
    if config_match is None:
        raise bad(6, config, f"is not 'b' + {BUILD_CONFIG_HASH_CHARS} lowercase hex digits")
    try:
        host = HostTuple(
            compute_capability=(int(gpu_match.group(1)), int(gpu_match.group(2))),
            gpu_sku=gpu_match.group(3),
            platform=platform,
            tensorrt_version=trt_match.group(1),
            precision=mode,
        )
    except ValueError as exc:
        raise _refuse(filename, str(exc)) from None
    return EngineName(
        label=label,
        model_sha256_prefix=model_match.group(1),
        host=host,
        build_config_hash=config_match.group(1),
    )


def engine_name_for(
    *, label: str, model_sha256: str, host: HostTuple, build_config: BuildConfig
) -> EngineName:
    """The name a builder gives the engine of ``model_sha256`` built with ``build_config``
    on ``host``.  ``label`` is sanitized; ``host.precision`` must be the config's."""
    digest = model_sha256.lower()
    if not _HEX64.fullmatch(digest):
        raise ValueError(f"model_sha256 must be a 64-digit hex SHA-256, got {model_sha256!r}")
    if host.precision != build_config.precision:
        raise ValueError(
            f"host tuple precision {host.precision.value} differs from the build config's "
            f"{build_config.precision.value}"
        )
    return EngineName(
        label=sanitize_label(label),
        model_sha256_prefix=digest[:MODEL_HASH_CHARS],
        host=host,
        build_config_hash=build_config_hash(build_config),
    )


def _words(text: str) -> str:
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")


def _truncate(words: str, limit: int) -> str:
    return words[:limit].strip("-")


def sanitize_label(text: str) -> str:
    """A schema-valid label from any text (a model name or file stem); ``model`` if empty."""
    return _truncate(_words(text), LABEL_MAX_CHARS) or "model"


def sanitize_sku(raw: str | bytes) -> str:
    """The schema's GPU SKU from a driver's device name (NVML or CUDA).

    Lowercase ASCII words joined by ``-``, a leading ``nvidia`` dropped, at most
    40 characters: ``"NVIDIA GeForce RTX 4090"`` -> ``geforce-rtx-4090``,
    ``"Orin (nvgpu)"`` -> ``orin-nvgpu``.  ``unknown`` if nothing is left.
    """
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    words = _words(text)
    if words.startswith("nvidia-"):
        words = words[len("nvidia-") :]
    return _truncate(words, GPU_SKU_MAX_CHARS) or "unknown"


def _canonical(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: _canonical(getattr(value, field.name))
            for field in dataclasses.fields(value)
        }
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _canonical(item) for key, item in value.items()}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return repr(value)  # exact and platform independent
    raise TypeError(f"cannot hash build config value {value!r} of type {type(value).__name__}")


def build_config_hash(config: BuildConfig) -> str:
    """Stable 12-hex-digit hash of a ``BuildConfig``: SHA-256 of its canonical JSON
    (every dataclass field by name, sorted keys, enums as their values, tuples as
    lists), under a ``inferd.build_config/1`` tag.  Equal configs hash equal on any
    machine and Python; any field change changes it."""
    document = {"schema": "inferd.build_config/1", "config": _canonical(config)}
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:BUILD_CONFIG_HASH_CHARS]
