"""Starts a run from safetensors files: each device's part of each tensor read from its byte range, through
the names and layouts of `rename`/`transpose` or a `WeightMap`."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from flaxstate import extras, locations, tree_paths
from flaxstate.checkpoint.safetensors import files
from flaxstate.checkpoint.safetensors.files import DTYPES, INDEX
from flaxstate.checkpoint.safetensors.naming import Rename, checked_map, renamer
from flaxstate.checkpoint.safetensors.weight_map import TRANSPOSED, Layout, WeightMap
from flaxstate.train_state import StateMismatchError

logger = logging.getLogger("flaxstate")


class SafetensorsReader:
    """Starts a run from safetensors files: the params from the files, a fresh optimizer state and step 0.

    An `init` for `TrainLoop` (`TrainLoop(init=fs.SafetensorsReader(path,
    model.init), ...)`, or the `nnx.Module` itself as `target`): the loop
    makes its state as from `target` (its other collections, batch
    statistics, come from there), and the params from the files, each
    device's part read from its byte range of the file
    (`safe_open(...).get_slice`) and placed with the state's sharding, so a
    process reads only what its devices hold, never a whole file.

    Names: `map`, a `WeightMap`, gives each tree path of the params its
    tensor's name and layout in the files (3-D attention kernels stored 2-D,
    tied params read from one tensor). Without it a tensor's name, through
    `rename`'s `(regex, replacement)` pairs applied in order (`re.sub`), is a
    '/'-joined tree path of the params (`Dense_0/kernel`); `transpose` (a
    regex, `re.search`, of those tree paths) names the 2-D tensors stored
    `(out, in)`. A dtype that differs from the params' is cast, and said
    once.

    A layout is applied to each device's part where that part is one block
    of the file's tensor (a q projection `(h d) e -> e h d` cut in heads or
    in the embedding); otherwise the process reads the tensor once, whole,
    and places each of its devices' parts from it.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> safetensors.numpy.save_file({"w": np.ones((3, 2), np.float32)}, path)
        >>> reader = SafetensorsReader(path, target=None, transpose="w")
        >>> reader.params({"w": np.zeros((2, 3), np.float32)})["w"].shape
        (2, 3)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        target: Any,
        *,
        map: WeightMap | Mapping[str, Any] | None = None,  # noqa: A002 (the name the contract gives)
        rename: Rename = None,
        transpose: str | None = None,
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
            map: a `WeightMap` (or its rules): each tree path's tensor name
                and layout in the files; the general form of `rename` and
                `transpose`, which it replaces.
            rename: `(regex, replacement)` pairs from the files' names to tree paths.
            transpose: a regex of the tree paths whose 2-D tensors the files hold transposed.

        Raises:
            ValueError: a path that is neither a `.safetensors` file nor a
                folder holding them, a bucket that does not answer (naming
                the URL), a malformed `rename` or `map`, or `map` beside
                `rename` or `transpose`.
        """
        self.path = locations.run_directory(path, "SafetensorsReader")  # a local path, or a checked bucket's URL
        self.target = target
        self.map = checked_map(map, rename, transpose, "SafetensorsReader")
        self._rename = renamer(rename, "SafetensorsReader")
        self._transpose = re.compile(transpose) if transpose is not None else None
        self._files = files.files_of(self.path)
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
        weight_map = files.index_of(self.path) if not self.path.is_file() else None
        with contextlib.ExitStack() as stack:
            handles = {file: files.opened(file, stack) for file in self._files}
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
            stored, problems = (self._renamed if self.map is None else self._mapped)(flat, handles, holders)
            if problems:
                advice = (
                    "Mend the map's rules (and skip= the files' tensors the model does not hold)."
                    if self.map is not None
                    else "Map the files' names with rename=[(regex, replacement), ...] and name (out, in) kernels "
                    "with transpose=; where a kernel's shape differs in more than its order (3-D attention "
                    "kernels stored 2-D) or params are tied, give map=fs.WeightMap({...}) with layouts."
                )
                raise StateMismatchError(
                    f"SafetensorsReader({str(self.path)!r}) does not fit the params: {'; '.join(problems)}. {advice}"
                )
            cast = sorted({f"{kind} -> {np.dtype(flat[path].dtype)}" for path, (_, _, _, kind, _) in stored.items()
                           if DTYPES.get(kind) != np.dtype(flat[path].dtype)})  # fmt: skip
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
            file, name, _, _, layout = stored[path]
            sharding = leaf_shardings.get(path)
            placed[path] = self._read(
                opening[file], name, layout, tuple(np.shape(leaf)), np.dtype(leaf.dtype), sharding
            )
        return jax.tree.unflatten(jax.tree.structure(template), [placed[path] for path in flat])

    def _renamed(
        self, flat: dict[str, Any], handles: dict[Path, Any], holders: dict[str, Path]
    ) -> tuple[dict[str, _Stored], list[str]]:
        """Each tree path's tensor through `rename` and `transpose`, and what does not fit, by kind."""
        stored = {}
        unexpected = []
        for path, name in tree_paths.rename({name: name for name in holders}, self._rename).items():
            if path not in flat:
                unexpected.append(f"{name} (as {path})" if path != name else name)
                continue
            piece = handles[holders[name]].get_slice(name)
            shape = tuple(piece.get_shape())
            flip = self._transpose is not None and bool(self._transpose.search(path)) and len(shape) == 2
            stored[path] = (holders[name], name, shape, piece.get_dtype(), TRANSPOSED if flip else None)
        missing = [f"{path} {list(np.shape(leaf))}" for path, leaf in flat.items() if path not in stored]
        differ = []
        for path, (_, name, shape, _, layout) in stored.items():
            flipped = shape[::-1] if layout is not None else shape
            if flipped != tuple(np.shape(flat[path])):
                transposed = " (transposed)" if flipped != shape else ""
                differ.append(f"{path} (expected {list(np.shape(flat[path]))}, found {name} {list(shape)}{transposed})")
        return stored, [
            *([f"unexpected (in the files, not the params): {', '.join(unexpected)}"] if unexpected else ()),
            *([f"missing (the params', in no file): {', '.join(missing)}"] if missing else ()),
            *([f"differ: {', '.join(differ)}"] if differ else ()),
        ]

    def _mapped(
        self, flat: dict[str, Any], handles: dict[Path, Any], holders: dict[str, Path]
    ) -> tuple[dict[str, _Stored], list[str]]:
        """Each tree path's tensor through the map, and what does not fit, by kind."""
        assert self.map is not None
        stored = {}
        uncovered, missing, unfit, differ = [], [], [], []
        read = set()
        for path, leaf in flat.items():
            shape = tuple(np.shape(leaf))
            entry = self.map.entry(path)
            if entry is None:
                uncovered.append(f"{path} {list(shape)}")
                continue
            read.add(entry.name)
            if entry.name not in holders:
                missing.append(f"{path} {list(shape)} (as {entry.name})")
                continue
            piece = handles[holders[entry.name]].get_slice(entry.name)
            found = tuple(piece.get_shape())
            stored[path] = (holders[entry.name], entry.name, found, piece.get_dtype(), entry.layout)
            if entry.layout is None:
                if found != shape:
                    differ.append(f"{path} (expected {list(shape)}, found {entry.name} {list(found)})")
                continue
            try:
                expected = entry.layout.file_shape(shape, np.dtype(leaf.dtype))
            except ValueError as error:
                unfit.append(
                    f"{path} {list(shape)} from {entry.name} {list(found)}: {entry.layout.pattern!r} ({error})"
                )
                continue
            if expected != found:
                differ.append(
                    f"{path} (expected {list(shape)}, which {entry.layout.pattern!r} stores as {list(expected)}; "
                    f"found {entry.name} {list(found)})"
                )
        unexpected = [name for name in holders if name not in read and not self.map.skips(name)]
        return stored, [
            *([f"no rule of the map covers (the params'): {', '.join(uncovered)}"] if uncovered else ()),
            *([f"unexpected (in the files, read by no rule): {', '.join(unexpected)}"] if unexpected else ()),
            *([f"missing (the map's names, in no file): {', '.join(missing)}"] if missing else ()),
            *([f"the layout does not fit: {', '.join(unfit)}"] if unfit else ()),
            *([f"differ: {', '.join(differ)}"] if differ else ()),
        ]

    def _read(
        self,
        opening: Callable[[], Any],
        name: str,
        layout: Layout | None,
        shape: tuple[int, ...],
        dtype: np.dtype,
        sharding: Any,
    ) -> Any:
        """One tensor as the params hold it: each device's part read alone (its byte range, through the layout where
        the part is one block of the file), or whole on the host (once for all this process's parts)."""
        whole: list[np.ndarray] = []

        def read(index: tuple[slice, ...]) -> np.ndarray:
            with opening() as handle:
                value = np.asarray(handle.get_tensor(name) if not index else handle.get_slice(name)[index])
            self.bytes_read += value.nbytes
            return value

        def part(index: tuple[slice, ...] | None = None) -> np.ndarray:
            index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
            if layout is None:
                value = read(index)
            else:
                within = layout.file_index(index, shape)
                if within is not None:
                    value = layout.to_tree(
                        read(within), [len(range(*cut.indices(n))) for cut, n in zip(index, shape, strict=True)]
                    )
                else:
                    if not whole:
                        whole.append(layout.to_tree(read(()), shape))
                    value = whole[0][index]
            value = value.astype(dtype, copy=False)
            # A layout's view (a transpose) is copied by the device's put, faster than numpy's copy into new pages.
            return value if sharding is not None else np.ascontiguousarray(value)

        if sharding is None:
            return part()
        return jax.make_array_from_callback(shape, sharding, part)


_Stored = tuple[Path, str, tuple[int, ...], str, Layout | None]
"""Where a tree path's tensor is: its file, its name, its shape and dtype there, and its layout."""
