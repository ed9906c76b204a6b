"""One directory of checkpoints on orbax: save, list, read. With `layout`, `saving` and `damage`, the only
modules that import orbax.

The layout of a step is `flaxstate.checkpoint.layout`'s. Arrays are saved as
the global arrays the loop holds (replicated arrays are stored once) and
restored into whatever sharding the caller asks for, so a checkpoint saved on
N devices or P processes restores on any other number. Saves are
asynchronous and atomic (`flaxstate.checkpoint.saving`); a failed save is
raised, naming its step, at the next save or when the writer waits (see
`flaxstate.background` for the end of a script). Only missing or damaged
files count as damage (`flaxstate.checkpoint.damage`). A step deleted while
it is read (a live writer rotating) is `VanishedStepError`, never damage.
Arrays are stored uncompressed: zstd took 2.2x the CPU time of a save and
gained 6% of the bytes of a trained float32 state (`benchmarks/checkpoint.py`).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from flaxstate import background, tree_paths
from flaxstate.checkpoint import damage, layout, saving
from flaxstate.checkpoint import meta as meta_format
from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.damage import DamagedCheckpointError, is_damage
from flaxstate.checkpoint.errors import CheckpointError, CheckpointSaveError
from flaxstate.checkpoint.layout import (
    LEGACY_RUN_ID,
    LEGACY_STATE,
    META,
    MODEL,
    OPTIMIZER,
    SET_ASIDE,
    TMP_MARK,
    StoredCheckpoint,
    decode_rng,
    encode_rng,
    is_empty_or_missing,
    to_json,
)
from flaxstate.records import FORMAT_VERSION
from flaxstate.train_state import StateMismatchError

__all__ = [
    "LEGACY_RUN_ID",
    "CheckpointError",
    "CheckpointSaveError",
    "CheckpointStore",
    "StoredCheckpoint",
    "VanishedStepError",
    "decode_rng",
    "encode_rng",
    "is_damage",
    "is_empty_or_missing",
    "to_json",
]

logger = logging.getLogger("flaxstate")

Rename = Mapping[str, str] | Callable[[str], str] | None
"""Regex rules from stored '/'-joined paths to a template's: `{old: new}`, or a function of a path."""

VANISHING_SECONDS = 1.0
"""How long a step whose read failed is watched for disappearing (a writer's rotation deletes it file by file)
before the failure is taken for damage."""

LISTING_ATTEMPTS = 20
"""How often a listing that met a step deleted under it is tried again."""


class VanishedStepError(CheckpointError):
    """A step that was listed and is gone: a live writer deleted it meanwhile (never damage)."""


class CheckpointStore(saving.SaveSlot):
    """The checkpoints of one directory: save, list, read.

    Args:
        directory: the orbax `CheckpointManager` directory.
        keep: how many checkpoints to keep (the newest, or with `best`, the best).
        best: keep the best by a metric instead of the newest.
        read_only: open for reading; nothing is created.

    Close it (`close()`, or `with CheckpointStore(...) as store:`) when done.
    """

    shared = True
    """Every process writes this one directory together: only the primary process changes it."""

    def __init__(
        self,
        directory: str | Path,
        keep: int | None = None,
        best: BestPolicy | None = None,
        read_only: bool = False,
    ) -> None:
        super().__init__()
        self.directory = Path(directory).absolute()
        best_options: dict[str, Any] = {}
        if best is not None:
            best_options = {"best_fn": lambda metrics: best.score(metrics[best.key]), "best_mode": best.mode}
        # In one process the asynchrony is ours (a thread runs a synchronous orbax save); else orbax's.
        self._own_thread = jax.process_count() == 1
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=not read_only,
            enable_async_checkpointing=not (read_only or self._own_thread),
            **best_options,
        )
        damage.quiet_orbax()
        self._manager = _listing(
            lambda: ocp.CheckpointManager(self.directory, options=options, item_handlers=layout.handlers()),
            self.directory,
        )
        self._layouts: dict[int, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}
        """The newest step `read_paths` read: its meta, items' trees and layout (a complete step never changes)."""
        if not read_only:
            background.track(self)

    def _release(self) -> None:
        super()._release()
        self._manager.close()

    # Writing.

    def save(
        self,
        step: int,
        state_dict: Mapping[str, Any],
        meta: Mapping[str, Any],
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Starts an asynchronous, atomic save of one checkpoint.

        In one process the arrays are read in the background: they must not
        be donated, deleted or changed until the save is done (`wait`).
        TrainLoop's records hold read-only host copies that nothing donates.

        Raises:
            CheckpointSaveError: this save, or the previous one, failed.
            CheckpointError: `step` is already saved (nothing saved is ever overwritten).
        """
        self.wait()
        if step in self._manager.all_steps():
            raise CheckpointError(f"{self.directory} already holds step {step}; a saved checkpoint is never replaced.")
        items = {
            MODEL: ocp.args.PyTreeSave({"target": state_dict["target"], "flax_mutables": state_dict["flax_mutables"]}),
            OPTIMIZER: ocp.args.PyTreeSave(dict(state_dict["state"])),
            META: ocp.args.JsonSave(to_json({**meta, "format_version": FORMAT_VERSION, "time": time.time()})),
        }
        args, metrics = ocp.args.Composite(**items), dict(metrics or {}) or None
        if self._own_thread:
            self._pending = saving.BackgroundSave(step, lambda: self._manager.save(step, args=args, metrics=metrics))
            return
        try:
            self._manager.save(step, args=args, metrics=metrics)
        except Exception as error:
            raise CheckpointSaveError(
                f"saving the checkpoint of step {step} to {self.directory} failed: {error}"
            ) from error
        self._pending = saving.OrbaxAsyncSave(step, self._manager)

    # Reading.

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return _listing(lambda: (self._manager.reload(), sorted(self._manager.all_steps()))[1], self.directory)

    def vanished(self, step: int) -> bool:
        """Whether a step is gone or going: its directory disappears within `VANISHING_SECONDS`."""
        step_dir = self.directory / str(step)
        deadline = time.monotonic() + VANISHING_SECONDS
        while step_dir.is_dir():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _reading(self, step: int, read: Callable[[], Any]) -> Any:
        """Runs a read of one step: a Ctrl-C comes out as `KeyboardInterrupt`, a step deleted meanwhile as
        `VanishedStepError`, anything else as it was raised."""
        try:
            return read()
        except Exception as error:
            damage.reraise_interrupt(error)
            # Files that read but do not validate are no deletion in progress: only a gone step is watched for.
            gone = not (self.directory / str(step)).is_dir() if isinstance(error, DamagedCheckpointError) else None
            if gone or (gone is None and self.vanished(step)):
                raise VanishedStepError(f"{self.directory / str(step)} was deleted while it was read.") from error
            raise

    def read_meta(self, step: int) -> dict[str, Any]:
        """Returns the JSON meta of one checkpoint, checked against the format.

        Raises:
            CheckpointError: the step holds no flaxstate meta, or was written
                by a newer flaxstate.
            DamagedCheckpointError: its meta is not valid JSON or does not
                validate (naming the file and the field).
            VanishedStepError: the step was deleted meanwhile.
        """
        step_dir = self.directory / str(step)

        def read() -> dict[str, Any]:
            if not (step_dir / META).is_dir():
                if not step_dir.is_dir():
                    raise FileNotFoundError(f"{step_dir} does not exist")
                raise CheckpointError(
                    f"{step_dir} is not a flaxstate checkpoint (it has no '{META}' item); "
                    "point the reader at a directory that flaxstate's writers wrote."
                )
            try:
                stored = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
            except json.JSONDecodeError as error:
                raise DamagedCheckpointError(
                    f"{step_dir / META / meta_format.FILE} is not valid JSON ({error}): the checkpoint is damaged"
                ) from error
            return meta_format.validate(stored[META], step_dir)

        return self._reading(step, read)

    def set_aside(self, step: int, suffix: str = SET_ASIDE) -> Path:
        """Moves a step out of orbax's sight (`<step><suffix>`, `.damaged` by default), keeping its files.

        Called on the primary process; the others see the move at their next
        listing. Returns the new path.
        """
        self.wait()
        step_dir = self.directory / str(step)
        target = saving.aside(step_dir, suffix)
        step_dir.rename(target)
        self._manager.reload()
        return target

    def remove_unfinished(self, step: int | None = None) -> list[Path]:
        """Removes orbax's temporary directories of saves that did not finish (of `step`, or of every step).

        Only a writer calls this, when no save of its own is running: such a
        directory is never a checkpoint, and orbax never lists or restores it.
        A failed save's last writes can still land on tensorstore's threads
        after its failure was raised, so a directory that comes back within
        `VANISHING_SECONDS` is removed again.
        """
        if jax.process_index() != 0 or not self.directory.is_dir():
            return []

        def unfinished() -> list[Path]:
            return [
                path
                for path in self.directory.iterdir()
                if TMP_MARK in path.name
                and path.name.split(".")[0].isdigit()
                and (step is None or path.name.split(".")[0] == str(step))
            ]

        removed = {path: None for path in unfinished()}
        deadline = time.monotonic() + VANISHING_SECONDS
        while removed:
            for path in unfinished():
                shutil.rmtree(path, ignore_errors=True)
                removed[path] = None
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return list(removed)

    def delete(self, steps: list[int]) -> None:
        """Removes whole checkpoints (orbax deletes them on the primary process)."""
        self.wait()
        for step in steps:
            self._manager.delete(step)
        self._manager.reload()

    def item_trees(self, step: int) -> dict[str, Any]:
        """Returns each item's tree of array metadata (shapes, dtypes), read once."""
        metadata = self._manager.item_metadata(step)
        return {
            name: item.tree if hasattr(item, "tree") else item
            for name, item in metadata.items()
            if item is not None and name != META
        }

    def stored_tree(self, step: int, with_optimizer: bool = True) -> dict[str, Any]:
        """Returns the stored state-dict layout with array metadata as leaves."""
        return self._stored(step, with_optimizer)[2]

    def _stored(self, step: int, with_optimizer: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """A step's meta, its items' trees, and the state-dict layout of those trees (metadata only)."""

        meta = self.read_meta(step)  # a read of its own (vanishing judged once, there)

        def read() -> tuple[dict[str, Any], dict[str, Any]]:
            trees = self.item_trees(step)
            return trees, layout.state_dict_layout({**meta, "step": step}, trees, with_optimizer)

        return (meta, *self._reading(step, read))

    def read_leaf(self, step: int, path: str) -> np.ndarray:
        """Reads one array of a checkpoint, by its state-dict path ('target/Dense_0/kernel'), as numpy.

        Only that array's bytes are read (orbax's partial restore), so two
        checkpoints larger than host memory can be compared leaf by leaf.

        Raises:
            CheckpointError: a checkpoint of format 1 (one item: read it whole), or no such path.
        """
        return self.read_paths(step, [path])[path]

    def read_paths(self, step: int, paths: list[str]) -> dict[str, np.ndarray]:
        """Reads some arrays of a checkpoint by their state-dict paths, as numpy, and no other (partial restores).

        Raises:
            CheckpointError: a checkpoint of format 1 (one item: read it whole), or a path it does not hold.
        """
        if step not in self._layouts:  # read once a step: a diff reads a step's arrays one call each
            self._layouts = {step: self._stored(step, True)}
        meta, trees, stored = self._layouts[step]
        if meta["format_version"] < 2:
            raise CheckpointError(f"{self.directory / str(step)} has format 1: read it whole (read()).")
        missing = sorted(set(paths) - set(tree_paths.flatten(stored)))
        if missing:
            raise CheckpointError(f"{self.directory / str(step)} holds no array at {', '.join(missing)}.")
        by_item: dict[str, dict[str, str]] = {}
        for path in paths:
            item, inner = (OPTIMIZER, path.removeprefix("state/")) if path.startswith("state/") else (MODEL, path)
            by_item.setdefault(item, {})[inner] = path
        items = {}
        for item, inner_paths in by_item.items():
            flat = tree_paths.flatten(trees[item])
            wanted = tree_paths.unflatten({inner: flat[inner] for inner in inner_paths})
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
            items[item] = ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args, partial_restore=True)
        restored = self._reading(step, lambda: self._manager.restore(step, args=ocp.args.Composite(**items)))
        out = {}
        for item, inner_paths in by_item.items():
            flat = tree_paths.flatten(restored[item])
            out.update({path: np.asarray(flat[inner]) for inner, path in inner_paths.items()})
        return out

    def read(
        self, step: int, template: Mapping[str, Any] | None, rename: Rename = None, with_optimizer: bool = True
    ) -> StoredCheckpoint:
        """Restores one checkpoint, checked against a template state dict.

        Args:
            step: the checkpoint's step.
            template: the state dict to restore into: its leaves' shapes,
                dtypes and shardings are the restored arrays' (numpy leaves
                restore as numpy); `None` restores numpy arrays of the stored tree.
            rename: regex rules from stored '/'-joined paths to the template's.
            with_optimizer: read the optimizer item; `False` never opens it.

        Returns:
            the state dict (template layout) and the meta.

        Raises:
            StateMismatchError: the stored tree differs from the template's,
                naming every missing, unexpected and mismatched path.
            CheckpointError: the step is not a flaxstate checkpoint.
        """
        meta, trees, stored = self._stored(step, with_optimizer)
        legacy = meta["format_version"] < 2
        stored_flat = tree_paths.flatten(stored)
        renamed = tree_paths.rename(stored_flat, rename)
        new_path = dict(zip(stored_flat, renamed, strict=True))
        if template is not None:
            expected = tree_paths.flatten(template)
            if not with_optimizer:
                expected = {k: v for k, v in expected.items() if not k.startswith("state/")}
            difference = tree_paths.diff(expected, renamed)
            if difference:
                raise StateMismatchError(
                    f"the checkpoint of step {step} in {self.directory} does not match the model:\n"
                    + difference.describe()
                    + "\nRestore into the model it was saved from, or map old paths to new ones with rename=."
                )
        else:
            self._check_claimed_sizes(step, stored_flat)

        def restore_args(path: str, leaf: Any) -> Any:
            target: Any = expected[new_path[path]] if template is not None and path in new_path else None
            if getattr(target, "sharding", None) is None:  # no template, or a host (numpy) leaf
                return ocp.RestoreArgs(restore_type=np.ndarray)
            return ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape, dtype=target.dtype)

        def item_args(prefix: str, tree: Any) -> ocp.args.PyTreeRestore:
            args = jax.tree_util.tree_map_with_path(
                lambda key_path, leaf: restore_args(prefix + tree_paths.path_name(key_path), leaf), tree
            )
            return ocp.args.PyTreeRestore(restore_args=args)

        if legacy:
            items = {LEGACY_STATE: item_args("", trees[LEGACY_STATE])}
        else:
            items = {MODEL: item_args("", trees[MODEL])}
            if with_optimizer:
                items[OPTIMIZER] = item_args("state/", trees[OPTIMIZER])
        restored = self._reading(step, lambda: self._manager.restore(step, args=ocp.args.Composite(**items)))
        if legacy:
            flat = tree_paths.flatten(restored[LEGACY_STATE])
        else:
            flat = tree_paths.flatten(restored[MODEL])
            if with_optimizer:
                flat.update({"state/" + k: v for k, v in tree_paths.flatten(restored[OPTIMIZER]).items()})
        flat = {new_path[path]: value for path, value in flat.items() if path in new_path}
        state_dict = tree_paths.unflatten(flat)
        state_dict.setdefault("flax_mutables", {})
        state_dict.setdefault("state", {})
        return StoredCheckpoint(state_dict=state_dict, meta=meta)

    def _check_claimed_sizes(self, step: int, stored_flat: Mapping[str, Any]) -> None:
        """Checks that the arrays a step claims fit in its files, before a read with no template allocates them.

        orbax stores arrays uncompressed (values equal to the fill value too),
        so the step's files hold at least the bytes of its arrays; a shape
        claimed beyond that is damaged metadata, and allocating it could end
        the process (`std::bad_alloc`).

        Raises:
            DamagedCheckpointError: naming the largest array, its claimed shape and the bound.
        """
        sizes = {}
        for path, leaf in stored_flat.items():
            shape, dtype = tree_paths.shape_and_dtype(leaf)
            if any(not isinstance(dim, int) or dim < 0 for dim in shape):
                raise DamagedCheckpointError(f"{self.directory / str(step)}: {path} claims an invalid shape {shape}.")
            sizes[path] = (math.prod(shape) * np.dtype(dtype).itemsize, shape)
        claimed = sum(size for size, _ in sizes.values())
        on_disk = _size_on_disk(self.directory / str(step))
        if claimed > on_disk:
            path, (size, shape) = max(sizes.items(), key=lambda item: item[1][0])
            raise DamagedCheckpointError(
                f"{self.directory / str(step)}: {path} claims shape {list(shape)} ({size:,} bytes), and its arrays "
                f"{claimed:,} bytes in all, but the step's files hold {on_disk:,} bytes (orbax stores arrays "
                "uncompressed): its array metadata is damaged. Nothing was allocated."
            )


def _size_on_disk(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def _listing(list_steps: Callable[[], Any], directory: Path) -> Any:
    """Runs a listing of a directory again when a step was deleted under it (a live writer's rotation).

    Raises:
        KeyboardInterrupt: Ctrl-C, wherever orbax wrapped it.
        CheckpointError: steps kept vanishing for `LISTING_ATTEMPTS` listings.
    """
    for _ in range(LISTING_ATTEMPTS):
        try:
            return list_steps()
        except (FileNotFoundError, NotADirectoryError):  # orbax's paths say either of a step being deleted
            time.sleep(0.05)
        except Exception as error:
            damage.reraise_interrupt(error)
            raise
    raise CheckpointError(f"{directory}: its steps kept vanishing while they were listed; is a writer deleting them?")
