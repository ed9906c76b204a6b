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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import serialization

from flaxstate import extras, locations, settings, tree_paths
from flaxstate.checkpoint import catalog
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.train_state import StateMismatchError

logger = logging.getLogger("flaxstate")

SINGLE = "model.safetensors"
"""The file of an export that fits one shard."""
INDEX = "model.safetensors.index.json"
"""The index of a sharded export: `metadata.total_size` and `weight_map` (name -> file), as transformers reads it."""
PARAMS = "target/"
"""Where a stored step keeps the params (its state dict's `target`)."""
EMA = "state/ema/"
"""Where a stored step keeps the EMA of the params (`TrainTask(ema_decay=...)`)."""
_EXPORTED = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")

Rename = Sequence[tuple[str, str]] | None

_KINDS: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jax.numpy.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
_DTYPES = {name: np.dtype(kind) for name, kind in _KINDS.items()}
"""The safetensors dtype names that numpy holds, as numpy dtypes."""
_NAMES = {kind: name for name, kind in _DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000
"""The largest header safetensors reads (its `MAX_HEADER_SIZE`): a file in a bucket is held to it too."""
STAGING = ".export-"
"""The prefix of an export's staging folder in its output folder: `.export-<pid>-<random>`."""
READ_BYTES = 2**28
"""The most bytes of tensors an export reads at once (a larger tensor alone): what it holds, not a shard."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of an export: its tree path, its name in the files, and its shape and dtype as written."""

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    transposed: bool

    @property
    def bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def export_safetensors(
    source: Any,
    out_dir: str | os.PathLike[str],
    *,
    rename: Rename = None,
    transpose: str | None = None,
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
            array that is not 2-D, `max_shard_bytes` not positive, or an
            unknown dtype or one safetensors does not hold (naming the
            paths and shapes); nothing is written.
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
    rules = _renamer(rename, "export_safetensors")
    transposed = re.compile(transpose) if transpose is not None else None
    out = locations.run_directory(out_dir, "export_safetensors")  # a local path, or a checked bucket's URL
    if not locations.is_url(out):
        _check_out_dir(out)
    with _reading(source, use_ema, step) as (shapes, read, metadata):
        tensors = _tensors(shapes, rules, transposed, stored)
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


def _renamer(rename: Rename, owner: str) -> Callable[[str], str] | None:
    """`rename`'s pairs as one function of a path (for `tree_paths.rename`), or `None` without any.

    Raises:
        ValueError: `rename` is not a list of `(regex, replacement)` pairs.
    """
    if rename is None:
        return None
    if isinstance(rename, Mapping) or isinstance(rename, str):
        raise ValueError(
            f"{owner} rename is a list of (regex, replacement) pairs, applied in order; got "
            f"{type(rename).__name__} {rename!r}."
        )
    rules = []
    for rule in rename:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and all(isinstance(part, str) for part in rule)):
            raise ValueError(f"{owner} rename: each rule is a (regex, replacement) pair; got {rule!r}.")
        rules.append((re.compile(rule[0]), rule[1]))

    def renamed(path: str) -> str:
        for pattern, replacement in rules:
            path = pattern.sub(replacement, path)
        return path

    return renamed


def _tensors(
    shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    rename: Callable[[str], str] | None,
    transposed: re.Pattern[str] | None,
    dtype: np.dtype | None,
) -> list[_Tensor]:
    """Each tensor's name, shape and dtype as written, every problem named before a byte is written.

    Raises:
        ValueError: two paths with one name (`tree_paths.rename`), or `transpose` naming an array that is not 2-D.
    """
    tensors: list[_Tensor] = []
    not_2d: list[str] = []
    unstorable: list[str] = []
    for name, path in tree_paths.rename({path: path for path in shapes}, rename).items():
        shape, stored = shapes[path]
        flip = transposed is not None and bool(transposed.search(path))
        if flip and len(shape) != 2:
            not_2d.append(f"{path} {list(shape)}")
        shape = tuple(shape[::-1]) if flip and len(shape) == 2 else tuple(shape)
        tensors.append(_Tensor(path, name, shape, dtype if dtype is not None else stored, flip))
        if np.dtype(tensors[-1].dtype) not in _NAMES:
            unstorable.append(f"{path} {tensors[-1].dtype}")
    if unstorable:
        raise ValueError(
            f"export_safetensors: safetensors has no dtype for {', '.join(unstorable)}; give dtype= one it holds "
            f"({', '.join(str(kind) for kind in _NAMES)})."
        )
    if not_2d:
        raise ValueError(
            f"export_safetensors transpose matches arrays that are not 2-D: {', '.join(not_2d)}; narrow its regex "
            "to the kernels stored (out, in)."
        )
    return tensors


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
            "dtype": _NAMES[np.dtype(tensor.dtype)],
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
    if tensor.transposed:
        value = value.T
    return np.ascontiguousarray(value.astype(tensor.dtype, copy=False))


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


class SafetensorsReader:
    """Starts a run from safetensors files: the params from the files, a fresh optimizer state and step 0.

    An `init` for `TrainLoop` (`TrainLoop(init=fs.SafetensorsReader(path,
    model.init), ...)`, or the `nnx.Module` itself as `target`): the loop
    makes its state as from `target` (its other collections, batch
    statistics, come from there), and the params from the files, each
    device's part read from its byte range of the file
    (`safe_open(...).get_slice`) and placed with the state's sharding, so a
    process reads only what its devices hold, never a whole file.

    Names: a tensor's name in the files, through `rename`'s `(regex,
    replacement)` pairs applied in order (`re.sub`), is a '/'-joined tree
    path of the params (`Dense_0/kernel`); `transpose` (a regex, `re.search`,
    of those tree paths) names the 2-D tensors stored `(out, in)`. A dtype
    that differs from the params' is cast, and said once.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> safetensors.numpy.save_file({"w": np.ones((3, 2), np.float32)}, path)
        >>> reader = SafetensorsReader(path, target=None, transpose="w")
        >>> reader.params({"w": np.zeros((2, 3), np.float32)})["w"].shape
        (2, 3)
    """

    def __init__(
        self, path: str | os.PathLike[str], target: Any, *, rename: Rename = None, transpose: str | None = None
    ) -> None:
        """Points the reader at the files (their headers are read when the params are).

        Args:
            path: a `.safetensors` file, or a folder holding one
                (`model.safetensors`) or shards with their
                `model.safetensors.index.json`; on a disk, or a `gs://` or
                `s3://` URL (each part then read by one ranged request for
                the rows it covers).
            target: the model's `init` (linen) or the `nnx.Module`: what the
                loop makes the rest of the state from.
            rename: `(regex, replacement)` pairs from the files' names to tree paths.
            transpose: a regex of the tree paths whose 2-D tensors the files hold transposed.

        Raises:
            ValueError: a path that is neither a `.safetensors` file nor a
                folder holding them, a bucket that does not answer (naming
                the URL), or a malformed `rename`.
        """
        self.path = locations.run_directory(path, "SafetensorsReader")  # a local path, or a checked bucket's URL
        self.target = target
        self._rename = _renamer(rename, "SafetensorsReader")
        self._transpose = re.compile(transpose) if transpose is not None else None
        self._files = _safetensors_files(self.path)
        self.bytes_read = 0
        """The bytes of tensor data read from the files so far (each device's part counts once it is read)."""

    def __repr__(self) -> str:
        return f"SafetensorsReader({str(self.path)!r})"

    def params(self, template: Any, shardings: Any = None) -> Any:
        """The files' tensors as `template`'s tree (its leaves' shapes and dtypes), placed with `shardings`.

        Args:
            template: the params' tree: arrays or `jax.ShapeDtypeStruct` leaves.
            shardings: a sharding for every leaf, or one tree of them;
                `None`: numpy arrays on the host.

        Returns:
            the tree, each leaf a `jax.Array` with its sharding (each
            device's part read alone), or a numpy array without shardings.

        Raises:
            StateMismatchError: a tensor the template lacks, a template path
                no file holds, or a shape that differs (after `transpose`),
                naming every path and both shapes; nothing is placed.
        """
        safe_open = extras.require("safetensors", "safetensors", "SafetensorsReader").safe_open

        flat = tree_paths.flatten(template)
        weight_map = _weight_map(self.path) if not self.path.is_file() else None
        with contextlib.ExitStack() as opened:
            handles = {file: _opened(file, opened) for file in self._files}
            holders: dict[str, Path] = {}
            for file, handle in handles.items():
                for name in handle.keys():
                    if name in holders:
                        raise ValueError(
                            f"SafetensorsReader: the tensor {name!r} is in both {holders[name]} and {file}; remove "
                            "the stale file, or give the one to read."
                        )
                    holders[name] = file
                    if weight_map is not None and weight_map.get(name) != file.name:
                        raise ValueError(
                            f"SafetensorsReader: {file} holds the tensor {name!r}, which {self.path / INDEX} gives "
                            f"to {weight_map.get(name) or 'no file'}; export the folder again, or mend its index."
                        )
            stored = {}  # tree path -> (file, name, shape in the file, dtype in the file)
            unexpected = []
            for file, handle in handles.items():
                for path, name in tree_paths.rename({name: name for name in handle.keys()}, self._rename).items():
                    if path not in flat:
                        unexpected.append(f"{name} (as {path})" if path != name else name)
                        continue
                    piece = handle.get_slice(name)
                    stored[path] = (file, name, tuple(piece.get_shape()), piece.get_dtype())
            missing = [f"{path} {list(np.shape(leaf))}" for path, leaf in flat.items() if path not in stored]
            differ = []
            for path, (_, name, shape, _) in stored.items():
                flipped = self._flipped(path, shape)
                if flipped != tuple(np.shape(flat[path])):
                    transposed = " (transposed)" if flipped != shape else ""
                    differ.append(
                        f"{path} (expected {list(np.shape(flat[path]))}, found {name} {list(shape)}{transposed})"
                    )
            if unexpected or missing or differ:
                parts = (
                    f"unexpected (in the files, not the params): {', '.join(unexpected)}" if unexpected else "",
                    f"missing (the params', in no file): {', '.join(missing)}" if missing else "",
                    f"differ: {', '.join(differ)}" if differ else "",
                )
                raise StateMismatchError(
                    f"SafetensorsReader({str(self.path)!r}) does not fit the params: "
                    + "; ".join(part for part in parts if part)
                    + ". Map the files' names with rename=[(regex, replacement), ...] and name (out, in) kernels "
                    "with transpose=."
                )
            cast = sorted({f"{kind} -> {np.dtype(flat[path].dtype)}" for path, (_, _, _, kind) in stored.items()
                           if _DTYPES.get(kind) != np.dtype(flat[path].dtype)})  # fmt: skip
            if cast:
                logger.warning("SafetensorsReader(%r) casts %s, as the params are.", str(self.path), ", ".join(cast))
            leaf_shardings: dict[str, Any] = {}
            if isinstance(shardings, jax.sharding.Sharding):
                leaf_shardings = dict.fromkeys(flat, shardings)
            elif shardings is not None:
                leaf_shardings = tree_paths.flatten(jax.tree.map(lambda _, sharding: sharding, template, shardings))
        # Each part then opens its file anew: a local file's mapped pages, which count in the process's resident
        # memory while it is open, are let go after each part (held open, the whole file's would add up).
        opening = {
            file: (lambda handle=handle: contextlib.nullcontext(handle))
            if locations.is_url(file)
            else (lambda file=file: safe_open(str(file), "numpy"))
            for file, handle in handles.items()
        }
        placed = {}
        for path, leaf in flat.items():
            file, name, shape, _ = stored[path]
            sharding = leaf_shardings.get(path)
            flip = self._flips(path, shape)
            placed[path] = self._read(opening[file], name, flip, tuple(np.shape(leaf)), np.dtype(leaf.dtype), sharding)
        return jax.tree.unflatten(jax.tree.structure(template), [placed[path] for path in flat])

    def _flips(self, path: str, shape: tuple[int, ...]) -> bool:
        return self._transpose is not None and bool(self._transpose.search(path)) and len(shape) == 2

    def _flipped(self, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[::-1] if self._flips(path, shape) else shape

    def _read(
        self,
        opening: Callable[[], Any],
        name: str,
        flip: bool,
        shape: tuple[int, ...],
        dtype: np.dtype,
        sharding: Any,
    ) -> Any:
        """One tensor as the params hold it: each device's part read alone (its byte range), or whole on the host."""

        def part(index: tuple[slice, ...] | None = None) -> np.ndarray:
            with opening() as handle:
                if not shape:
                    value = np.asarray(handle.get_tensor(name))
                else:
                    index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
                    value = handle.get_slice(name)[index[::-1] if flip else index]
                    value = value.T if flip else value
            self.bytes_read += np.asarray(value).nbytes
            return np.ascontiguousarray(np.asarray(value).astype(dtype, copy=False))

        if sharding is None:
            return part()
        return jax.make_array_from_callback(shape, sharding, part)


def _opened(file: Path, opened: contextlib.ExitStack) -> Any:
    """A file's reader: `_InBucket` for a bucket's (checked as `safe_open` checks one), else `safe_open`'s own.

    Raises:
        ValueError: a file that is not safetensors (cut, a bad header), naming it.
    """
    if locations.is_url(file):
        return _InBucket(file)
    safe_open = extras.require("safetensors", "safetensors", "SafetensorsReader").safe_open

    try:
        return opened.enter_context(safe_open(str(file), "numpy"))
    except Exception as error:  # safetensors_rust.SafetensorError, which names no file
        raise ValueError(f"{file} is not a safetensors file that can be read: {error}.") from error


class _InBucket:
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
        if dtype not in _DTYPES:
            raise self._refused(f"{name!r} has the dtype {dtype!r}, which is none of {', '.join(_DTYPES)}")
        if not isinstance(shape, list) or not all(type(size) is int and size >= 0 for size in shape):
            raise self._refused(f"{name!r} has the shape {shape!r}, not a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(offset) is int for offset in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise self._refused(f"{name!r} has the data_offsets {offsets!r}, not [start, end] with start <= end")
        expected = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize
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
    """One tensor of an `_InBucket` file: indexed by slices, it reads the rows they cover and no others."""

    file: _InBucket
    shape: tuple[int, ...]
    dtype: str
    start: int

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        dtype = _DTYPES[self.dtype]
        if not self.shape:
            data = locations.read_range(self.file.path, self.start, self.start + dtype.itemsize)
            return np.frombuffer(bytearray(data), dtype).reshape(())
        first, last, _ = (tuple(index)[0] if index else slice(None)).indices(self.shape[0])
        row = int(np.prod(self.shape[1:], dtype=np.int64)) * dtype.itemsize
        data = locations.read_range(self.file.path, self.start + first * row, self.start + max(first, last) * row)
        rows = np.frombuffer(bytearray(data), dtype).reshape((max(0, last - first), *self.shape[1:]))
        return rows[(slice(None), *tuple(index)[1:])]


def _weight_map(folder: Path) -> dict[str, str] | None:
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


def _safetensors_files(path: Path) -> list[Path]:
    """The files of a `.safetensors` file or folder (a folder's index lists its shards).

    Raises:
        ValueError: neither a `.safetensors` file nor a folder holding them; a malformed index.
    """
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if path.is_dir():
        weight_map = _weight_map(path)
        if weight_map is not None:
            return [path / name for name in sorted(set(weight_map.values()))]
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
    raise ValueError(
        f"SafetensorsReader: {path} is neither a .safetensors file nor a folder holding model.safetensors (or shards "
        f"with their {INDEX}); give the file or the exported folder."
    )
