"""The safetensors format as flaxstate reads it: dtypes, a folder's files and its index, a file on a disk or in
a bucket, each checked before it is trusted.

A file is an 8-byte little-endian header length, the header (JSON: each
tensor's dtype, shape and `data_offsets` after it), then the tensors' bytes,
row-major. `safe_open` reads one on a disk; `InBucket` reads one in a bucket
the same way, by ranged requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import jax
import numpy as np

from flaxstate import extras, locations

SINGLE = "model.safetensors"
"""The file of an export that fits one shard."""
INDEX = "model.safetensors.index.json"
"""The index of a sharded export: `metadata.total_size` and `weight_map` (name -> file), as transformers reads it."""

_KINDS: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jax.numpy.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
DTYPES = {name: np.dtype(kind) for name, kind in _KINDS.items()}
"""The safetensors dtype names that numpy holds, as numpy dtypes."""
NAMES = {kind: name for name, kind in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000
"""The largest header safetensors reads (its `MAX_HEADER_SIZE`): a file in a bucket is held to it too."""


def opened(file: Path, stack: contextlib.ExitStack) -> Any:
    """A file's reader: `InBucket` for a bucket's (checked as `safe_open` checks one), else `safe_open`'s own.

    Raises:
        ValueError: a file that is not safetensors (cut, a bad header), naming it.
    """
    if locations.is_url(file):
        return InBucket(file)
    safe_open = extras.require("safetensors", "safetensors", "SafetensorsReader").safe_open

    try:
        return stack.enter_context(safe_open(str(file), "numpy"))
    except Exception as error:  # safetensors_rust.SafetensorError, which names no file
        raise ValueError(f"{file} is not a safetensors file that can be read: {error}.") from error


class InBucket:
    """A safetensors file in a bucket, read as `safe_open` reads one on a disk: its header once, then only the
    byte ranges of the parts asked for, each one ranged request (`locations.read_range`).

    `safe_open` takes a local file name only; the format is an 8-byte little-endian header length, the header
    (JSON: each tensor's dtype, shape and `data_offsets` after it), then the tensors' bytes, row-major.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        size = locations.size(path)
        if size < 8:
            raise self._refused(f"it holds {size} bytes, fewer than the 8 of a header's length (a cut or empty file)")
        (length,) = struct.unpack("<Q", locations.read_range(path, 0, 8))
        if length > MAX_HEADER_BYTES:
            raise self._refused(f"its header's length is {length} bytes, more than safetensors' {MAX_HEADER_BYTES}")
        if 8 + length > size:
            raise self._refused(f"its header's length is {length} bytes, past the end of its {size} (a cut file)")
        try:
            header = json.loads(locations.read_range(path, 8, 8 + length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._refused(f"its header is not UTF-8 JSON ({error})") from None
        if not isinstance(header, dict):
            raise self._refused(f"its header is a JSON {type(header).__name__}, not an object")
        header.pop("__metadata__", None)
        self._header = {name: self._checked(name, entry) for name, entry in header.items()}
        end = 0
        for name, (start, stop) in sorted(
            ((name, entry["data_offsets"]) for name, entry in self._header.items()), key=lambda item: item[1]
        ):
            if start != end:
                fault = "overlaps the tensor before it" if start < end else f"leaves bytes {end}-{start} unread"
                raise self._refused(f"{name!r}'s data_offsets [{start}, {stop}] {fault}")
            end = stop
        if 8 + length + end != size:
            raise self._refused(
                f"its tensors end at byte {8 + length + end} of the file and the file has {size} (cut, or extra bytes)"
            )
        self._data = 8 + length

    def _refused(self, fault: str) -> ValueError:
        return ValueError(f"{self.path} is not a safetensors file that can be read: {fault}.")

    def _checked(self, name: str, entry: Any) -> dict[str, Any]:
        """One tensor's header entry, checked as `safe_open` checks it."""
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise self._refused(f"the header's entry of {name!r} is not an object with dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise self._refused(f"{name!r} has the dtype {dtype!r}, which is none of {', '.join(DTYPES)}")
        if not isinstance(shape, list) or not all(type(size) is int and size >= 0 for size in shape):
            raise self._refused(f"{name!r} has the shape {shape!r}, not a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(offset) is int for offset in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise self._refused(f"{name!r} has the data_offsets {offsets!r}, not [start, end] with start <= end")
        expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != expected:
            raise self._refused(
                f"{name!r}'s data_offsets {offsets} cover {offsets[1] - offsets[0]} bytes; its shape {shape} of "
                f"{dtype} takes {expected}"
            )
        return entry

    def keys(self) -> list[str]:
        return list(self._header)

    def get_slice(self, name: str) -> _BucketTensor:
        entry = self._header[name]
        return _BucketTensor(self, tuple(entry["shape"]), entry["dtype"], self._data + entry["data_offsets"][0])

    def get_tensor(self, name: str) -> np.ndarray:
        return self.get_slice(name)[()]


@dataclasses.dataclass(frozen=True)
class _BucketTensor:
    """One tensor of an `InBucket` file: indexed by slices, it reads the rows they cover and no others."""

    file: InBucket
    shape: tuple[int, ...]
    dtype: str
    start: int

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        dtype = DTYPES[self.dtype]
        if not self.shape:
            data = locations.read_range(self.file.path, self.start, self.start + dtype.itemsize)
            return np.frombuffer(bytearray(data), dtype).reshape(())
        first, last, _ = (tuple(index)[0] if index else slice(None)).indices(self.shape[0])
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * dtype.itemsize
        data = locations.read_range(self.file.path, self.start + first * row, self.start + max(first, last) * row)
        rows = np.frombuffer(bytearray(data), dtype).reshape((max(0, last - first), *self.shape[1:]))
        return rows[(slice(None), *tuple(index)[1:])]


def index_of(folder: Path) -> dict[str, str] | None:
    """A folder's index: `{tensor name: file name}`, each file a plain name in the folder; `None` without one.

    Raises:
        ValueError: an index that is not JSON, whose `weight_map` is not an object of names, or that names a file
            outside the folder (a path, '..'), naming the index and the entry.
    """
    index = folder / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"{index} is not a safetensors index: not a JSON object ({error}).") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()
    ):
        raise ValueError(
            f"{index} is not a safetensors index: its weight_map is {type(weight_map).__name__}, not an object "
            "of tensor names to file names."
        )
    for name, file in weight_map.items():
        if file in ("", ".", "..") or "/" in file or "\\" in file or not file.endswith(".safetensors"):
            raise ValueError(
                f"{index} maps {name!r} to {file!r}: only the name of a .safetensors file in {folder} is followed, "
                "never a path."
            )
    return weight_map


def files_of(path: Path) -> list[Path]:
    """The files of a `.safetensors` file or folder (a folder's index lists its shards).

    Raises:
        ValueError: neither a `.safetensors` file nor a folder holding them; a malformed index.
    """
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if path.is_dir():
        weight_map = index_of(path)
        if weight_map is not None:
            return [path / name for name in sorted(set(weight_map.values()))]
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
    raise ValueError(
        f"SafetensorsReader: {path} is neither a .safetensors file nor a folder holding model.safetensors (or shards "
        f"with their {INDEX}); give the file or the exported folder."
    )
