"""What ``inferctl infer`` sends and reports: random inputs from the model's spec,
arrays from ``.npy`` files (never unpickled), copies in a shared region for
``--shm``, and each tensor's summary."""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Any, BinaryIO

import numpy as np

from inferd_client.client import InferenceClient
from inferd_client.errors import RemoteError
from inferd_wire.regions import REGION_ALIGNMENT

#: How an .npy file starts (``numpy.lib.format.MAGIC_PREFIX``), and a zip (.npz).
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"


def spec_of(described: dict[str, Any], model: str) -> dict[str, Any]:
    specs = {entry["name"]: entry for entry in described.get("models", [])}
    if model not in specs:
        raise RemoteError("NOT_FOUND", f"no model named {model!r}; served: {sorted(specs)}")
    spec: dict[str, Any] = specs[model]
    return spec


def in_region(
    client: InferenceClient, inputs: dict[str, np.ndarray], spec: dict[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Copies of ``inputs`` in a new shared region, and arrays there for each output
    whose shape the model fixes (a dynamic one comes back as a frame)."""
    static = [
        entry for entry in spec.get("outputs", []) if all(dim is not None for dim in entry["shape"])
    ]
    sizes = [array.nbytes for array in inputs.values()]
    sizes += [int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize for e in static]
    region = client.shared_region(sum(size + REGION_ALIGNMENT for size in sizes), label="inferctl")
    in_region = {}
    for name, array in inputs.items():
        # Regions hold little-endian tensors: a big-endian .npy is converted.
        in_region[name] = region.array(array.shape, array.dtype.newbyteorder("<"))
        np.copyto(in_region[name], array)
    outputs = {e["name"]: region.array(e["shape"], e["dtype"]) for e in static}
    return in_region, outputs


def random_inputs(described: dict[str, Any], model: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {}
    for spec in spec_of(described, model)["inputs"]:
        profile = spec.get("profile")
        # An input with a profile accepts only shapes within it: use its opt shape.
        shape = (
            tuple(profile["opt_shape"])
            if profile
            else tuple(1 if dim is None else dim for dim in spec["shape"])
        )
        dtype = np.dtype(spec["dtype"])
        if dtype.kind == "f":
            inputs[spec["name"]] = rng.random(shape, dtype=np.float64).astype(dtype)
        elif dtype.kind == "b":
            inputs[spec["name"]] = rng.random(shape) < 0.5
        else:
            info = np.iinfo(dtype)
            low, high = max(info.min, -128), min(info.max, 127)
            inputs[spec["name"]] = rng.integers(low, high, shape, dtype=dtype, endpoint=True)
    return inputs


def load_npy(items: list[str]) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    for item in items:
        name, separator, path = item.partition("=")
        if not separator or not name or not path:
            raise ValueError(f"--npy takes NAME=FILE.npy, got {item!r}")
        if name in inputs:
            raise ValueError(f"--npy {item}: input {name!r} is given twice")
        with _regular_file(item, path) as file:
            inputs[name] = _read_npy(item, file)
    return inputs


def _regular_file(item: str, path: str) -> BinaryIO:
    """``path`` open for reading, when it is a regular file: a FIFO would be waited
    on for a writer (for ever, past ``--timeout``), and a device read as data."""
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"--npy {item}: cannot open it: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(
                f"--npy {item}: not a regular file (a FIFO, a device or a directory); "
                "--npy reads an array's .npy file"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_npy(item: str, file: BinaryIO) -> np.ndarray:
    """The array of an .npy file; never unpickled (``allow_pickle=False``: loading
    an .npy file never executes code)."""
    magic = file.read(len(_NPY_MAGIC))
    if magic.startswith(_ZIP_MAGIC):
        raise ValueError(f"--npy {item}: an .npz archive; --npy takes one array's .npy file")
    if magic != _NPY_MAGIC:
        # numpy would call it pickled data, and advise loading it with allow_pickle.
        raise ValueError(f"--npy {item}: not an .npy file (it does not start with {_NPY_MAGIC!r})")
    file.seek(0)
    try:
        array: np.ndarray = np.lib.format.read_array(file, allow_pickle=False)
    except ValueError as exc:  # truncated, an object dtype (pickled), a bad header
        raise ValueError(f"--npy {item}: {exc}") from None
    except (EOFError, MemoryError) as exc:
        # A header cut short; one that claims more than memory holds.
        raise ValueError(f"--npy {item}: not an array's .npy file: {exc}") from None
    return array


def describe_array(array: np.ndarray) -> dict[str, Any]:
    # The bytes as the wire carries them, little-endian (a big-endian .npy is sent
    # so): the same tensor has the same sha256 with or without --shm.
    wire = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    contiguous = np.ascontiguousarray(array, dtype=wire)
    return {
        "dtype": array.dtype.name,
        "shape": list(array.shape),
        "sha256": hashlib.sha256(contiguous.tobytes()).hexdigest(),
        "min": float(array.min()) if array.size else None,
        "max": float(array.max()) if array.size else None,
        "mean": float(array.mean()) if array.size else None,
    }
