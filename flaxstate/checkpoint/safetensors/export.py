"""A run's parameters out to the safetensors ecosystem: an HF-style folder that vLLM and transformers load.

`export_safetensors` writes the params (or their EMA) of a run directory's
step, of a `Checkpoint` record or of a train state as `model.safetensors`,
or as shards `model-00001-of-0000N.safetensors` of at most
`max_shard_bytes` each with their `model.safetensors.index.json`, as
transformers writes them. Names are the params' '/'-joined tree paths
(`Dense_0/kernel`), or what `rename`'s `(regex, replacement)` pairs make of
them, applied in order as `re.sub`; `transpose` names the 2-D kernels to
store as `(out, in)` (HF's layout, against flax's `(in, out)`).

From a run directory only the params' arrays are read from storage, a
shard's at a time: never the optimizer's state, and never more than one
shard's arrays in host memory. The files are written into a folder of
their own beside the export and moved in when all are whole: a failure
leaves an earlier export in `out_dir` as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import serialization

from flaxstate import locations, settings, tree_paths
from flaxstate.checkpoint import catalog
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.safetensors.files import INDEX, NAMES, SINGLE
from flaxstate.checkpoint.safetensors.naming import Rename, checked_map, renamer
from flaxstate.checkpoint.safetensors.weight_map import TRANSPOSED, Entry, Layout, WeightMap
from flaxstate.train_state import StateMismatchError

logger = logging.getLogger("flaxstate")

PARAMS = "target/"
"""Where a stored step keeps the params (its state dict's `target`)."""
EMA = "state/ema/"
"""Where a stored step keeps the EMA of the params (`TrainTask(ema_decay=...)`)."""
_EXPORTED = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")

STAGING = ".export-"
"""The prefix of an export's staging folder in its output folder: `.export-<pid>-<random>`."""
READ_BYTES = 2**28
"""The most bytes of tensors an export reads at once (a larger tensor alone): what it holds, not a shard."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of an export: its tree path, its name in the files, its shape and dtype as written, and the
    layout that makes the tree's array the file's (`None`: as it is)."""

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: Layout | None

    @property
    def bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def export_safetensors(
    source: Any,
    out_dir: str | os.PathLike[str],
    *,
    rename: Rename = None,
    transpose: str | None = None,
    map: WeightMap | Mapping[str, Any] | None = None,  # noqa: A002 (the name the contract gives)
    dtype: Any = None,
    use_ema: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    step: int | None = None,
) -> Path:
    """Writes a run's params as safetensors files, as transformers' `save_pretrained` lays them out.

    The tensors are read a few at a time (from a run directory: those
    arrays alone, `READ_BYTES` of them or one larger tensor), written and
    dropped before the next: the export holds that, never a whole shard.

    Args:
        source: a run directory (local, `gs://`, `s3://`: its newest intact
            step, or `step`), a `Checkpoint` record, or a train state
            (`loop.state`, an `InferenceState`).
        out_dir: the folder to write: a local path (made if missing; an
            earlier export in it is replaced only once this one is whole),
            or a `gs://` or `s3://` URL (the files are written on this
            host's temporary disk, then uploaded, each one object, the
            shards before their index).
        rename: `(regex, replacement)` pairs applied in order (`re.sub`) to
            each '/'-joined tree path, giving the tensor's name in the files
            (without: the tree path itself).
        transpose: a regex (`re.search`) of the tree paths whose 2-D arrays
            are stored transposed, `(out, in)`.
        map: a `WeightMap` (or its rules): each tree path's tensor name and
            layout, applied backwards; tied params are written once. The
            general form of `rename` and `transpose`, which it replaces.
        dtype: the dtype to store (e.g. `"bfloat16"`, the usual serving
            dtype); `None` keeps each array's.
        use_ema: the EMA of the params (`TrainTask(ema_decay=...)`) instead.
        max_shard_bytes: the most bytes of one file; a larger tensor goes
            alone into a shard of its own.
        step: with a run directory, this step instead of the newest.

    Returns:
        `out_dir`, as a `Path`.

    Raises:
        CheckpointError: a run directory without checkpoints or without the
            step; `use_ema` where the state holds no EMA.
        ValueError: two paths renamed to one name, `transpose` naming an
            array that is not 2-D, `map` beside `rename` or `transpose`,
            tied params that differ (naming both paths), `max_shard_bytes`
            not positive, or an unknown dtype or one safetensors does not
            hold (naming the paths and shapes); nothing is written.
        StateMismatchError: a tree path no rule of `map` covers, or a
            layout that does not fit a param (naming the path, the tensor's
            name and the shapes); nothing is written.
        TypeError: a source of another kind.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy
        >>> from flaxstate.train_state import InferenceState
        >>> state = InferenceState.create({"params": {"Dense_0": {"kernel": np.ones((2, 3), np.float32)}}})
        >>> out = export_safetensors(state, tempfile.mkdtemp(), transpose=r"kernel$")
        >>> safetensors.numpy.load_file(out / "model.safetensors")["Dense_0/kernel"].shape
        (3, 2)
    """
    max_shard_bytes = settings.count("export_safetensors", "max_shard_bytes", max_shard_bytes)
    stored = _stored_dtype(dtype)
    weight_map = checked_map(map, rename, transpose, "export_safetensors")
    rules = renamer(rename, "export_safetensors")
    transposed = re.compile(transpose) if transpose is not None else None
    out = locations.run_directory(out_dir, "export_safetensors")  # a local path, or a checked bucket's URL
    if not locations.is_url(out):
        _check_out_dir(out)
    with _reading(source, use_ema, step) as (shapes, read, metadata):
        entries = _renamed(shapes, rules, transposed) if weight_map is None else _mapped(shapes, weight_map)
        tensors, ties = _tensors(shapes, entries, stored)
        _check_ties(ties, read)
        shards = _shards(tensors, max_shard_bytes)
        if not locations.is_url(out):
            out.mkdir(parents=True, exist_ok=True)
            _remove_stale_staging(out)
        # Beside the export on a disk (moved in by a rename); for a bucket on this host's disk, uploaded from there.
        staging = Path(tempfile.mkdtemp(prefix=f"{STAGING}{os.getpid()}-", dir=None if locations.is_url(out) else out))
        try:
            names = _file_names(len(shards))
            for shard, name in zip(shards, names, strict=True):
                _write_file(staging / name, shard, read, metadata)
            if len(shards) > 1:
                index = {
                    "metadata": {"total_size": sum(tensor.bytes for tensor in tensors)},
                    "weight_map": {
                        tensor.name: name for shard, name in zip(shards, names, strict=True) for tensor in shard
                    },
                }
                (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            _move_in(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


@contextlib.contextmanager
def _reading(
    source: Any, use_ema: bool, step: int | None
) -> Iterator[tuple[dict[str, tuple[tuple[int, ...], np.dtype]], Callable[[list[str]], dict], dict[str, str]]]:
    """The params of a source: their shapes, a reader of some of them (numpy, by tree path), and the metadata.

    Raises:
        CheckpointError: `use_ema` where the source holds no EMA.
        TypeError: a source of another kind, or `step` with a record or a state.
        ValueError: a live state sharded across processes.
    """
    if isinstance(source, str | os.PathLike):
        with catalog.stored_step(os.fspath(source), step) as (store, chosen, leaves, meta):
            prefix = EMA if use_ema else PARAMS
            shapes = {
                leaf.path.removeprefix(prefix): (leaf.shape, np.dtype(leaf.dtype))
                for leaf in leaves
                if leaf.path.startswith(prefix)
            }
            if not shapes:
                raise _missing_ema(chosen, store.directory)

            def read(paths: list[str]) -> dict[str, np.ndarray]:
                arrays = store.read_paths(chosen, [prefix + path for path in paths])
                return {path.removeprefix(prefix): value for path, value in arrays.items()}

            yield shapes, read, _metadata(chosen, meta.get("metadata"))
        return
    if step is not None:
        raise TypeError("export_safetensors(step=...) takes a run directory; a record or a state is its own step.")
    state = getattr(source, "state", None) if not hasattr(source, "params") else source
    if state is None or not hasattr(state, "params"):
        raise TypeError(
            "export_safetensors takes a run directory, a Checkpoint record or a train state; got "
            f"{type(source).__name__}."
        )
    params = getattr(state, "ema", None) if use_ema else state.params
    if params is None:
        raise _missing_ema(int(np.asarray(state.step)), None)
    flat = tree_paths.flatten(serialization.to_state_dict(nn.meta.unbox(params)))
    for path, value in flat.items():
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            raise ValueError(
                f"export_safetensors: {path} is sharded across processes; export the run directory that its "
                "writer saved (each tensor is then read from storage), not the live state."
            )
    shapes = {path: tree_paths.shape_and_dtype(value) for path, value in flat.items()}
    metadata = _metadata(int(np.asarray(state.step)), getattr(source, "metadata", None))
    yield shapes, lambda paths: {path: np.asarray(flat[path]) for path in paths}, metadata


def _missing_ema(step: int, directory: Path | None) -> CheckpointError:
    where = f" in {directory}" if directory is not None else ""
    return CheckpointError(
        f"export_safetensors(use_ema=True): the state of step {step}{where} holds no EMA of the parameters; "
        "train with TrainTask(ema_decay=...), or export without use_ema."
    )


def _metadata(step: int, config: Any) -> dict[str, str]:
    """The files' `__metadata__` (strings only): transformers' `format` (`pt`: the layout it loads), the step,
    flaxstate's version and the run's config as JSON."""
    from flaxstate import __version__

    metadata = {"format": "pt", "flaxstate_step": str(step), "flaxstate_version": __version__}
    if config is not None:
        metadata["flaxstate_config"] = json.dumps(config, sort_keys=True, default=str)
    return metadata


def _stored_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        return np.dtype(jax.numpy.dtype(dtype))
    except TypeError:
        raise ValueError(
            f"export_safetensors dtype={dtype!r} is not a dtype; give one such as 'bfloat16', 'float16' or 'float32'."
        ) from None


def _renamed(
    shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    rename: Callable[[str], str] | None,
    transposed: re.Pattern[str] | None,
) -> dict[str, Entry]:
    """Each tree path's name and layout through `rename` and `transpose`.

    Raises:
        ValueError: two paths with one name (`tree_paths.rename`), or `transpose` naming an array that is not 2-D.
    """
    entries = {}
    not_2d = []
    for name, path in tree_paths.rename({path: path for path in shapes}, rename).items():
        flip = transposed is not None and bool(transposed.search(path))
        if flip and len(shapes[path][0]) != 2:
            not_2d.append(f"{path} {list(shapes[path][0])}")
        entries[path] = Entry(name, TRANSPOSED if flip else None)
    if not_2d:
        raise ValueError(
            f"export_safetensors transpose matches arrays that are not 2-D: {', '.join(not_2d)}; narrow its regex "
            "to the kernels stored (out, in), or give map= a layout for them."
        )
    return entries


def _mapped(shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]], weight_map: WeightMap) -> dict[str, Entry]:
    """Each tree path's name and layout through `weight_map`.

    Raises:
        StateMismatchError: tree paths no rule covers, naming each with its shape.
    """
    entries = {path: weight_map.entry(path) for path in shapes}
    uncovered = [f"{path} {list(shapes[path][0])}" for path, entry in entries.items() if entry is None]
    if uncovered:
        raise StateMismatchError(
            f"export_safetensors: no rule of the map covers {', '.join(uncovered)}; add a rule for each "
            f"({weight_map!r})."
        )
    return {path: entry for path, entry in entries.items() if entry is not None}


def _tensors(
    shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]], entries: Mapping[str, Entry], dtype: np.dtype | None
) -> tuple[list[_Tensor], list[list[_Tensor]]]:
    """Each tensor's name, shape and dtype as written, and the groups of tied params (several tree paths of one
    name), every problem named before a byte is written.

    Raises:
        StateMismatchError: a layout that does not fit a param, or tied params whose shapes in the file differ.
        ValueError: a dtype safetensors does not hold.
    """
    named: dict[str, list[_Tensor]] = {}
    unfit: list[str] = []
    unstorable: list[str] = []
    for path, entry in entries.items():
        shape, kind = shapes[path]
        kind = dtype if dtype is not None else kind
        if entry.layout is not None:
            try:
                file_shape = entry.layout.file_shape(shape, kind)
            except ValueError as error:
                unfit.append(
                    f"{path} {list(shape)} -> {entry.name}: the layout {entry.layout.pattern!r} does not fit ({error})"
                )
                continue
        else:
            file_shape = tuple(shape)
        named.setdefault(entry.name, []).append(_Tensor(path, entry.name, file_shape, kind, entry.layout))
        if np.dtype(kind) not in NAMES:
            unstorable.append(f"{path} {kind}")
    for name, tied in named.items():
        if len({tensor.shape for tensor in tied}) > 1:
            unfit.append(
                f"{name} is tied to {' and '.join(tensor.path for tensor in tied)}, which give it the shapes "
                f"{' and '.join(str(list(tensor.shape)) for tensor in tied)}"
            )
    if unstorable:
        raise ValueError(
            f"export_safetensors: safetensors has no dtype for {', '.join(unstorable)}; give dtype= one it holds "
            f"({', '.join(str(kind) for kind in NAMES)})."
        )
    if unfit:
        raise StateMismatchError(f"export_safetensors: {'; '.join(unfit)}. Mend the map's layouts or names.")
    return [tied[0] for tied in named.values()], [tied for tied in named.values() if len(tied) > 1]


def _check_ties(ties: list[list[_Tensor]], read: Callable[[list[str]], dict]) -> None:
    """Refuses tied params that differ: one tensor in the files cannot hold both.

    Raises:
        ValueError: naming both tree paths, the tensor and the largest difference.
    """
    for tied in ties:
        arrays = read([tensor.path for tensor in tied])
        first = _as_stored(arrays[tied[0].path], tied[0])
        for tensor in tied[1:]:
            other = _as_stored(arrays[tensor.path], tensor)
            if not np.array_equal(first, other):
                largest = float(np.max(np.abs(first.astype(np.float64) - other.astype(np.float64))))
                raise ValueError(
                    f"export_safetensors: {tied[0].path} and {tensor.path} are tied (the map names one tensor, "
                    f"{tensor.name}, for both) but differ, by up to {largest:g}; the files hold one of them. Give "
                    "each its own name in the map, or tie the params in the model."
                )


def _shards(tensors: list[_Tensor], max_shard_bytes: int) -> list[list[_Tensor]]:
    """The tensors in order, cut into files of at most `max_shard_bytes` (a larger tensor alone in its own)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.bytes
    return shards


def _write_file(
    path: Path, tensors: list[_Tensor], read: Callable[[list[str]], dict], metadata: dict[str, str]
) -> None:
    """One safetensors file, a few tensors at a time: the header (each tensor's dtype, shape and byte offsets)
    first, then the tensors' bytes as they are read, `READ_BYTES` of them or one larger tensor, then dropped.

    The format (`safetensors.numpy.save_file` takes every array at once): an 8-byte little-endian header length,
    the header (JSON, padded with spaces to 8 bytes), then the tensors' bytes, row-major, in the header's order.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": NAMES[np.dtype(tensor.dtype)],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.bytes],
        }
        offset += tensor.bytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for group in _shards(tensors, READ_BYTES):  # one read of several small tensors: one restore call
            arrays = read([tensor.path for tensor in group])
            for tensor in group:
                value = _as_stored(arrays.pop(tensor.path), tensor)
                file.write(value.reshape(-1).view(np.uint8).data)


def _file_names(n_shards: int) -> list[str]:
    if n_shards == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)]


def _as_stored(value: np.ndarray, tensor: _Tensor) -> np.ndarray:
    value = np.asarray(value)
    if tensor.layout is not None:
        value = _contiguous(tensor.layout.to_file(value))
    return np.ascontiguousarray(value.astype(tensor.dtype, copy=False))


def _contiguous(view: np.ndarray) -> np.ndarray:
    """A layout's view (a transpose) as a row-major array: copied by a put onto the host's CPU device, which
    copies a transpose a few times faster than numpy's `ascontiguousarray` (0.04 s against 0.14 s for 256 MiB)."""
    if view.flags.c_contiguous:
        return view
    return np.asarray(jax.device_put(view, jax.devices("cpu")[0]))


def _check_out_dir(out: Path) -> None:
    """Refuses an output folder that is a file, or that cannot be made, naming it (before anything is read).

    Raises:
        ValueError: naming the path and the fault.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"export_safetensors: {out} is a file, not a folder; give a folder to write the files into.")
    existing = next(parent for parent in (out, *out.parents) if parent.exists())
    if not existing.is_dir():
        raise ValueError(f"export_safetensors: {out} cannot be made: {existing} is a file, not a folder.")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"export_safetensors: {out} cannot be written: {existing} is not writable.")


def _remove_stale_staging(out: Path) -> None:
    """Removes the staging folders of exports into `out` that ended without finishing (killed: their process is
    gone), so that none leaks; a running export's is left alone."""
    for entry in out.glob(f"{STAGING}*"):
        pid = entry.name.removeprefix(STAGING).split("-")[0]
        if entry.is_dir() and not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether a process of this id runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_in(staging: Path, out: Path) -> None:
    """Replaces an earlier export in `out` by the whole one in `staging` (its other files left alone).

    On a disk each file is renamed in; to a bucket, which has no rename, each is uploaded (one object, seen
    once whole), the shards before their index.
    """
    new = sorted(entry.name for entry in staging.iterdir())
    for name in sorted(new, key=lambda name: name == INDEX):
        if locations.is_url(out):
            locations.upload(staging / name, out / name)
        else:
            os.replace(staging / name, out / name)
    for entry in out.iterdir() if out.is_dir() else ():  # an earlier export's shards that this one does not have
        if _EXPORTED.match(entry.name) and entry.name not in new and entry.is_file():
            entry.unlink()
