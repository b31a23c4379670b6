"""INT8 calibration data, checked against the network before a build starts.

TensorRT's calibrator hands TensorRT one device pointer per network input
(``IInt8Calibrator.get_batch``) and TensorRT reads the input's whole volume from
it: the calibration profile's opt shape for an input with dynamic dimensions
(TensorRT calibrates at kOPT), the static shape otherwise.  A batch that is
short, of another dtype, or that names other inputs is nothing TensorRT can
see: it reads past the buffer or calibrates on garbage.  So every ``.npz``
batch is checked here, from the ONNX model and the build config alone (no
TensorRT, no GPU), before the builder is made: the array names are exactly the
network's inputs, each array has its input's dtype and exactly its calibration
shape.  The same check runs again on each batch as the calibrator loads it (a
file changed in between is refused, never fed).  The network's inputs are read
from the model's bytes whose digest is the build's (``ModelSource.read``), the
model the build parses, never from its path again: a model replaced meanwhile
fails the build (``ModelChangedError``) instead of having the batches checked
against another model's inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inferd.engine_build.model_source import ModelChangedError, ModelSource
from inferd.errors import CalibrationDataError
from inferd.model_bytes import parse_model
from inferd.owned_files import open_regular_file
from inferd.types import OptimizationProfile

#: An input as the network declares it: numpy dtype and shape (-1: a runtime dimension).
InputDecl = tuple[np.dtype[Any], tuple[int, ...]]


@dataclass(frozen=True)
class CalibrationInput:
    """One network input as every calibration batch must hold it."""

    name: str
    dtype: np.dtype[Any]
    #: What TensorRT reads per batch: the opt shape of the input's calibration
    #: profile when ``dynamic``, else the network's static shape.
    shape: tuple[int, ...]
    dynamic: bool

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def expected(self) -> str:
        where = "the calibration profile's opt shape" if self.dynamic else "its static shape"
        return f"{self.dtype.name} {list(self.shape)} ({where})"


@dataclass(frozen=True)
class CalibrationBatches:
    """A data set whose every batch fits the network (``check_calibration_batches``)."""

    dataset: Path
    files: tuple[Path, ...]
    inputs: tuple[CalibrationInput, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def batch_size(self) -> int:
        """``get_batch_size`` (deprecated and unused by explicit-batch TensorRT 10)."""
        first = self.inputs[0].shape if self.inputs else ()
        return first[0] if first else 1

    def load(self, path: Path) -> dict[str, np.ndarray]:
        """The batch's arrays, C-contiguous, checked again (the file may have changed)."""
        arrays = _read(path)
        _refuse(path, _problems(arrays, self.inputs))
        return {spec.name: np.ascontiguousarray(arrays[spec.name]) for spec in self.inputs}


def npz_batches(dataset: Path) -> list[Path]:
    """The data set's batches: the file itself, or the ``*.npz`` of a directory, sorted."""
    files = [dataset] if dataset.is_file() else sorted(dataset.glob("*.npz"))
    if not files:
        raise CalibrationDataError(f"calibration data set {dataset} holds no .npz batches")
    return files


def onnx_inputs(source: ModelSource) -> dict[str, InputDecl]:
    """The network inputs TensorRT's ONNX parser makes: graph inputs that are not
    initializers, with their dtype and shape (symbolic or unknown dims as -1), as
    the bytes with the build's digest declare them (read and parsed once, without
    external data); ``ModelChangedError`` when the model has another digest now."""
    from onnx import helper

    model_path = source.path
    try:
        data, _hashed = source.read()
        model = parse_model(data)
    except ModelChangedError:
        raise
    except Exception as exc:  # OSError, onnx's DecodeError, ...
        raise CalibrationDataError(f"cannot read {model_path.name}: {exc}") from exc
    initializers = {tensor.name for tensor in model.graph.initializer}
    inputs: dict[str, InputDecl] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        except (KeyError, TypeError) as exc:
            raise CalibrationDataError(
                f"{model_path.name}: input {value.name!r} has ONNX element type "
                f"{tensor_type.elem_type}, which INT8 calibration cannot feed"
            ) from exc
        dims = tuple(
            dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else -1
            for dim in tensor_type.shape.dim
        )
        inputs[value.name] = (dtype, dims)
    return inputs


def calibration_inputs(
    inputs: Mapping[str, InputDecl],
    profiles: Mapping[str, OptimizationProfile],
    model: str,
) -> tuple[CalibrationInput, ...]:
    """Each input's calibration shape.  ``profiles``: the build's profile per input,
    already checked against the network (``tensorrt_build.check_profiles``)."""
    specs: list[CalibrationInput] = []
    for name, (dtype, shape) in inputs.items():
        dynamic = any(dim < 0 for dim in shape)
        profile = profiles.get(name)
        if dynamic and profile is None:
            raise CalibrationDataError(
                f"{model}: input {name!r} {list(shape)} has dynamic dimensions and no "
                "optimisation profile; INT8 calibration runs at the profile's opt shape"
            )
        calibration_shape = tuple(profile.opt_shape) if profile is not None and dynamic else shape
        specs.append(CalibrationInput(name, dtype, calibration_shape, dynamic))
    return tuple(specs)


def check_calibration_batches(
    dataset: Path, inputs: tuple[CalibrationInput, ...]
) -> CalibrationBatches:
    """Every batch of ``dataset`` against ``inputs``; raises ``CalibrationDataError``
    naming the file, the input, what the network expects and what the file holds."""
    files = npz_batches(dataset)
    for path in files:
        _refuse(path, _problems(_read(path), inputs))
    return CalibrationBatches(dataset, tuple(files), inputs)


def _read(path: Path) -> dict[str, np.ndarray]:
    # The operator's file (a symlink followed), opened as a regular file: a FIFO
    # named ``*.npz`` in the data set is refused, not waited on until the deadline.
    try:
        handle, _info = open_regular_file(path, follow=True)
        with handle, np.load(handle, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except Exception as exc:  # zipfile.BadZipFile, ValueError (pickled objects), OSError
        raise CalibrationDataError(f"calibration batch {path}: cannot read it: {exc}") from exc


def _problems(arrays: Mapping[str, np.ndarray], inputs: tuple[CalibrationInput, ...]) -> list[str]:
    wanted = [spec.name for spec in inputs]
    problems: list[str] = []
    missing = [name for name in wanted if name not in arrays]
    extra = sorted(name for name in arrays if name not in wanted)
    if missing:
        problems.append(f"lacks input(s) {missing}")
    if extra:
        problems.append(f"has array(s) {extra} that are not network inputs")
    if missing or extra:
        problems[-1] += f" (the network's inputs are {wanted})"
    for spec in inputs:
        array = arrays.get(spec.name)
        if array is None:
            continue
        if array.dtype != spec.dtype or tuple(array.shape) != spec.shape:
            problems.append(
                f"input {spec.name!r} is {array.dtype.name} {list(array.shape)}, the network "
                f"expects {spec.expected()}"
            )
    return problems


def _refuse(path: Path, problems: list[str]) -> None:
    if problems:
        raise CalibrationDataError(f"calibration batch {path}: " + "; ".join(problems))
